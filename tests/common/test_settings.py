"""Env registry and dataclass-derived CLI flags."""

import argparse

import pytest

from services.common.settings import ENV, add_dataclass_arguments, dataclass_from_args, env, env_list
from services.engine.config import EngineConfig, MoEBackend


def test_env_default_and_override(monkeypatch):
    monkeypatch.delenv("TANDEM_ENGINES", raising=False)
    assert env("TANDEM_ENGINES") == ENV["TANDEM_ENGINES"].default
    monkeypatch.setenv("TANDEM_ENGINES", " http://a:1 , ,http://b:2")
    assert env_list("TANDEM_ENGINES") == ["http://a:1", "http://b:2"]


def test_profiles_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_PROFILES_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env("TANDEM_PROFILES_DIR") == str(tmp_path / "tandem" / "profiles")


def test_undeclared_env_is_an_error():
    with pytest.raises(KeyError):
        env("TANDEM_NOT_DECLARED")


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, EngineConfig)
    return parser, parser.parse_args(argv)


def test_flags_derived_from_fields(monkeypatch):
    monkeypatch.setenv("TANDEM_MODEL", "synthetic:tiny")
    parser, args = _parse(["--moe-backend", "offload", "--moe-cache-rate", "0.5", "--max-seq-len", "128"])
    cfg = dataclass_from_args(EngineConfig, args)
    assert cfg.model == "synthetic:tiny"  # env default
    assert cfg.moe_backend is MoEBackend.OFFLOAD
    assert cfg.moe_cache_rate == 0.5 and cfg.max_seq_len == 128
    help_text = parser.format_help()
    for f in ("--moe-cache-auto", "--gpu-memory-limit", "--moe-hybrid-max-fetch", "TANDEM_MODEL"):
        assert f in help_text


def test_help_shows_a_derived_default_as_unset_not_none():
    help_text = " ".join(_parse([])[0].format_help().split())  # argparse wraps lines
    assert "(default: None)" not in help_text
    assert "unset = lfu, or lru with --moe-prefetch (default: unset)" in help_text
    assert "(default: 64)" in help_text  # a plain default is still shown as itself (--max-waiting-requests)


def test_bad_choice_is_rejected(capsys):
    with pytest.raises(SystemExit):
        _parse(["--moe-backend", "magic"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("prog, main, flags, why", [
    ("tandem engine", "services.engine.api", ["--model", "demo", "--moe-prefetch", "-1"], "--moe-prefetch must be"),
    ("tandem gateway", "services.gateway.app", ["--max-body-bytes", "0"], "--max-body-bytes must be positive"),
    ("tandem serve", "services.serve", ["--model", "demo", "--max-seq-len", "0"], "--max-seq-len must be positive"),
])
def test_a_bad_flag_ends_a_command_with_one_line_and_status_2(prog, main, flags, why, capsys):
    """Checked before anything starts (no model load, no server): `prog: why` on stderr, exit status 2."""
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(main).main(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: {why}") and "Traceback" not in err
