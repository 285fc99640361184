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


def test_bad_choice_is_rejected(capsys):
    with pytest.raises(SystemExit):
        _parse(["--moe-backend", "magic"])
    assert "invalid choice" in capsys.readouterr().err
