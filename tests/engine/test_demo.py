"""The demo checkpoint writer (services/engine/models/demo.py).

transformers is the independent check of the layout: it must load config, weights (every tensor
name used, none missing) and tokenizer from the written dir."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.models import demo
from services.engine.models.demo import (CHECKPOINT_FILES, MARKER, ensure_demo_checkpoint, is_complete,
                                         write_demo_checkpoint)

ROOT = Path(__file__).resolve().parents[2]


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", seed=0)


def test_files_and_config(ckpt):
    assert {p.name for p in ckpt.iterdir()} == {*CHECKPOINT_FILES, MARKER}
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert (config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]) == (4, 16, 4)
    assert config["tie_word_embeddings"] is False and config["norm_topk_prob"] is True
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    n_tokens = len(tok["model"]["vocab"])
    assert n_tokens <= config["vocab_size"] < n_tokens + 128
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert (gen["do_sample"], gen["temperature"], gen["top_p"], gen["top_k"]) == (True, 0.7, 0.8, 20)


def test_loads_in_transformers(ckpt):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # The per-expert Hub names were mapped onto the right tensors (transformers fuses experts).
    sd = load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.3.mlp.experts.15.down_proj.weight" in sd
    experts = model.model.layers[2].mlp.experts
    I = json.loads((ckpt / "config.json").read_text())["moe_intermediate_size"]
    assert torch.equal(experts.gate_up_proj[5, :I], sd["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[5, I:], sd["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(experts.down_proj[5], sd["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])

    hf_tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
    ids = hf_tok("Hello café 😀", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()


def test_deterministic_per_seed(ckpt, tmp_path):
    again = write_demo_checkpoint(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(ckpt)
    other = write_demo_checkpoint(tmp_path / "other", seed=1)
    d0, d1 = _digests(ckpt), _digests(other)
    assert d0["model.safetensors"] != d1["model.safetensors"]
    assert d0["tokenizer.json"] == d1["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_write_into_existing_dir(tmp_path):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    write_demo_checkpoint(target, seed=0)
    write_demo_checkpoint(target, seed=2)  # over an existing demo too
    assert (target / "notes.txt").read_text() == "keep me"
    assert is_complete(target, seed=2)
    assert _leftovers(tmp_path) == []


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def fail_after_config(directory, seed):
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C halfway through

    monkeypatch.setattr(demo, "_write_into", fail_after_config)
    with pytest.raises(KeyboardInterrupt):
        write_demo_checkpoint(tmp_path / "ckpt", seed=0)
    assert list(tmp_path.iterdir()) == []


def test_ensure_writes_once_and_repairs(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "demo"
    monkeypatch.setenv("TANDEM_DEMO_DIR", str(target))
    assert ensure_demo_checkpoint() == target and is_complete(target)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    (target / MARKER).unlink()  # an incomplete dir is written again
    ensure_demo_checkpoint()
    assert is_complete(target) and _leftovers(target.parent) == []


def test_ensure_uses_xdg_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_DEMO_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ensure_demo_checkpoint() == tmp_path / "tandem" / "demo"


def _tandem() -> list[str]:
    script = ROOT / ".venv" / "bin" / "tandem"
    return [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]


def test_cli(tmp_path, ckpt):
    out = subprocess.run([*_tandem(), "model", "demo", str(tmp_path / "cli")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote demo checkpoint" in out.stdout
    assert _digests(tmp_path / "cli") == _digests(ckpt)
    helptext = subprocess.run([*_tandem(), "model", "demo", "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    assert helptext.returncode == 0 and "--seed" in helptext.stdout and "DIR" in helptext.stdout


def test_stale_temp_dirs_are_removed(tmp_path):
    import os

    stale = tmp_path / ".ckpt.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    os.utime(stale, (0, 0))  # abandoned long ago by a killed writer
    fresh = tmp_path / ".ckpt.tmp-live"
    fresh.mkdir()  # another writer at work right now: left alone
    write_demo_checkpoint(tmp_path / "ckpt", seed=0)
    assert _leftovers(tmp_path) == [fresh.name]


def test_cli_error_on_file_target(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    out = subprocess.run([*_tandem(), "model", "demo", str(target)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "not a directory" in out.stderr


def test_ensure_other_seed_beside(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DEMO_DIR", str(tmp_path / "demo"))
    seeded = ensure_demo_checkpoint(seed=3)
    assert seeded == tmp_path / "demo-seed3" and is_complete(seeded, seed=3)
    assert not (tmp_path / "demo").exists()
