"""Settings plumbing shared by every service (torch-free).

Two things live here:
- ``ENV``: every environment variable Tandem reads, declared once with its default and meaning
  (vLLM ``envs.py`` style). Nothing else reads ``os.environ`` for Tandem settings.
- ``add_dataclass_arguments`` / ``dataclass_from_args``: CLI flags derived from a config dataclass
  (SGLang ``ServerArgs`` style), so flag names, defaults and help text cannot drift from the config;
  ``config_or_exit``: the same for a command's main, a bad value ending it with one line and status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import urlsplit, urlunsplit


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str


def _xdg_profiles_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache) / "tandem" / "profiles")


ENV: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("TANDEM_MODEL", "demo", "what the engine serves: a checkpoint dir, 'demo' or 'synthetic:NAME'"),
        EnvVar("TANDEM_REDIS_URL", "redis://127.0.0.1:6379/0", "Celery broker and result backend"),
        EnvVar("TANDEM_PROFILES_DIR", "", "bandwidth profiles (shared volume); empty = $XDG_CACHE_HOME/tandem/profiles"),
        EnvVar("TANDEM_API_KEYS", "", "comma-separated Bearer keys accepted on /v1; empty = no auth"),
        EnvVar("TANDEM_ADMIN_TOKEN", "", "Bearer token for /admin; empty = admin API disabled"),
        EnvVar("TANDEM_ENGINE_TOKEN", "", "Bearer token of the engine's internal API (/engine/v1), sent by the gateway; empty = no token (keep the engine on loopback)"),
        EnvVar("TANDEM_ENGINES", "http://127.0.0.1:8001", "comma-separated engine URLs behind the gateway"),
        EnvVar("TANDEM_ENGINES_DNS", "", "http://NAME:PORT: the gateway's engines are every address NAME resolves to "
               "(a headless Service); empty = TANDEM_ENGINES only"),
        EnvVar("TANDEM_NODE_NAME", "", "the node (host) a profiler worker runs on, from the downward API on Kubernetes: "
               "its queue is tandem.profiler.<node>; empty = the hostname"),
        EnvVar("TANDEM_LOG_LEVEL", "INFO", "log level of every service"),
        EnvVar("TANDEM_EXT_DIR", "", "where the CPU executor's C++ extension is built; empty = $XDG_CACHE_HOME/tandem/ext"),
        EnvVar("TANDEM_DEMO_DIR", "", "where `--model demo` writes its checkpoint; empty = $XDG_CACHE_HOME/tandem/demo"),
        EnvVar("TANDEM_CUDA_GRAPHS", "1", "0 = decode steps run eagerly on CUDA instead of replaying CUDA graphs: to debug a "
               "capture problem; several times slower per token"),
        EnvVar("TANDEM_WORKER_METRICS_PORT", "9101", "profiler worker's Prometheus port (0 = off)"),
        EnvVar("TANDEM_PROFILER_QUEUE", "", "profiler worker's own queue (one per GPU host); empty = tandem.profiler.<hostname>"),
    )
}


def env(name: str) -> str:
    """The value of a declared Tandem environment variable (its default when unset or empty)."""
    var = ENV[name]  # KeyError: undeclared variable — declare it in ENV first
    value = os.environ.get(name, "")
    if name == "TANDEM_PROFILES_DIR" and not value:
        return _xdg_profiles_dir()
    return value or var.default


def env_list(name: str) -> list[str]:
    """A comma-separated variable as a list, blanks dropped."""
    return [item.strip() for item in env(name).split(",") if item.strip()]


# ---------------------------------------------------------------------------------------------
# CLI flags from dataclass fields.
# Field metadata keys: help (required), env (name in ENV whose value becomes the default),
# flag (override of the derived --flag-name), secret (--help says whether it is set, never the value).
# ---------------------------------------------------------------------------------------------


def field(default: Any = dataclasses.MISSING, *, help: str, env: str | None = None, flag: str | None = None,
          secret: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that carries its CLI help (and optional env default). ``secret``: a key or
    token, which `--help` must not print (it shows "set" or "unset" instead of the default)."""
    metadata = {"help": help, "env": env, "flag": flag, "secret": secret}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per field of ``cls`` (types, defaults, choices and help from the field)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("help"):
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        typ = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.metadata.get("env"):
            default = env(f.metadata["env"])
        help_text = f.metadata["help"]
        if f.metadata.get("env"):
            help_text += f" [env {f.metadata['env']}]"
        # None means "derived from other flags" (each such help says how), so it reads as "unset", not "None"
        shown = "unset" if default is None else "%(default)s"
        if f.metadata.get("secret"):  # argparse would print the key itself (from the environment)
            shown = "set" if default else "unset"
        elif isinstance(default, str) and redact_url(default) != default:  # a URL with a password in it
            shown = redact_url(default).replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "help": f"{help_text} (default: {shown})"}
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=bool(default), **kwargs)
            continue
        base = _optional_base(typ)
        if isinstance(base, type) and issubclass(base, enum.Enum):
            kwargs["choices"] = [m.value for m in base]
            default = default.value if isinstance(default, enum.Enum) else default
            base = str
        parser.add_argument(flag, type=base, default=default, **kwargs)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """Build ``cls`` from parsed args (fields missing from ``args`` keep their defaults)."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        base = _optional_base(hints[f.name])
        if value is not None and isinstance(base, type) and issubclass(base, enum.Enum):
            value = base(value)
        values[f.name] = value
    values.update(overrides)
    return cls(**values)


def config_or_exit(prog: str, cls: type, args: argparse.Namespace, **overrides: Any):
    """``dataclass_from_args`` for a command's main: a value the config rejects (its ValueError) prints
    ``prog: <why>`` to stderr and exits with status 2, instead of a traceback."""
    try:
        return dataclass_from_args(cls, args, **overrides)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def redact_url(url: str) -> str:
    """``url`` with the password of its user-info replaced by ``***`` (redis://:pw@host -> redis://:***@host),
    for messages and logs: a URL from the environment may carry a credential."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def redact(text: str, url: str) -> str:
    """``text`` (an error message that may quote ``url`` or its password) with the password masked."""
    password = urlsplit(url).password
    text = text.replace(url, redact_url(url))
    return text.replace(password, "***") if password else text


def _optional_base(typ: Any) -> Any:
    """``int | None`` -> ``int``; other types unchanged."""
    args = getattr(typ, "__args__", None)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0]
    return typ
