"""`tandem` — the one entry point. Each command lives in the module that owns it and parses its own
flags (``main(argv) -> int``); this file only routes, so `tandem CMD --help` is always the owner's help."""

from __future__ import annotations

import importlib
import sys

# command words -> (module:function, one-line summary)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("services.serve:main", "gateway + engine in one process (single machine)"),
    ("engine",): ("services.engine.api:main", "the engine service alone (internal HTTP API)"),
    ("gateway",): ("services.gateway.app:main", "the OpenAI-compatible gateway alone"),
    ("stack",): ("services.local_stack:main", "redis + worker + engine + gateway + Prometheus as local processes"),
    ("model", "demo"): ("services.engine.models.demo:main", "write the small demo MoE checkpoint (HF layout)"),
    ("bench", "bw"): ("services.profiler.bench_bw:main", "measure host/PCIe bandwidths, write a profile"),
    ("bench", "load"): ("services.profiler.bench_load:main", "compare checkpoint loading strategies"),
    ("bench", "cache-copy"): ("benchmarks.bench_offload_cache_copy:main", "time copy_missing over bs x miss rate"),
    ("bench", "suite"): ("benchmarks.suite:main", "the results page's benchmarks on this host: ceilings, decode, serving"),
}


def version() -> str:
    """The installed distribution's version (pyproject.toml's, once `pip install -e .` ran)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tandem")
    except PackageNotFoundError:
        return "(not installed: run `pip install -e .` in the repository)"


def _usage() -> str:
    lines = ["usage: tandem COMMAND [flags]   (tandem COMMAND --help for each command's flags)",
             "       tandem --version", "", "commands:"]
    for words, (_, summary) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<18} {summary}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, func_name = target.split(":")
            func = getattr(importlib.import_module(module_name), func_name)
            return int(func(argv[len(words):]) or 0)
    if argv[:1] == ["--version"]:
        print(f"tandem {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    print(f"tandem: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
