"""Bad checkpoints get a LoaderError that names the file (and the tensor, where one is at fault)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.config import EngineConfig
from services.engine.models.errors import LoaderError
from services.engine.models.loader import load_checkpoint
from services.engine.models.registry import load_model

ROUTER = "model.layers.0.mlp.gate.weight"
EXPERT = "model.layers.2.mlp.experts.5.up_proj.weight"


@pytest.fixture
def ckpt(hf_checkpoints, tmp_path):
    """A private copy of the single-file qwen3_moe checkpoint to damage."""
    d = tmp_path / "qwen3"
    shutil.copytree(hf_checkpoints["qwen3_moe"].dir, d)
    return d


@pytest.fixture
def sharded(hf_checkpoints, tmp_path):
    d = tmp_path / "qwen2"
    shutil.copytree(hf_checkpoints["qwen2_moe"].dir, d)
    return d


def _load(d):
    return load_checkpoint(d, torch.device("cpu"), torch.float32)


def _rewrite(d, edit) -> None:
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def test_loads_when_intact(ckpt):
    spec, model, banks = _load(ckpt)
    assert spec.num_moe_layers == 2 and banks.layers[0].tensors["gate_up"].shape == (8, 64, 64)


@pytest.mark.parametrize("name", [ROUTER, EXPERT])
def test_missing_tensor_names_file_and_tensor(ckpt, name):
    _rewrite(ckpt, lambda sd: sd.pop(name))
    with pytest.raises(LoaderError, match=rf"model\.safetensors.*missing tensor '{name}'"):
        _load(ckpt)


@pytest.mark.parametrize("name", [ROUTER, EXPERT])
def test_wrong_shape_names_file_tensor_and_shapes(ckpt, name):
    def edit(sd):
        sd[name] = torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1])
    _rewrite(ckpt, edit)
    with pytest.raises(LoaderError, match=rf"model\.safetensors: tensor '{name}' has shape \[\d+, \d+\], expected"):
        _load(ckpt)


def test_truncated_file_names_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(LoaderError, match=r"model\.safetensors.*(corrupt|truncated)"):
        _load(ckpt)


def test_corrupt_header_names_file(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"#" * 16  # the JSON header starts at byte 8
    path.write_bytes(bytes(data))
    with pytest.raises(LoaderError, match=r"model\.safetensors: corrupt or truncated"):
        _load(ckpt)


def test_unsupported_model_type_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoaderError, match=r"config\.json: unsupported model_type 'llama' "
                                          r"\(supported: gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe\)"):
        load_model(EngineConfig(model=str(ckpt)))


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(LoaderError, match=r"tokenizer\.json: missing tokenizer\.json"):
        _load(ckpt)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(LoaderError, match=r"config\.json: missing config\.json"):
        _load(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(LoaderError, match=r"no model\.safetensors and no model\.safetensors\.index\.json"):
        _load(ckpt)


def test_missing_shard_names_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.3.mlp.experts.7.down_proj.weight"]
    (sharded / shard).unlink()
    with pytest.raises(LoaderError, match=rf"{shard}: shard file listed in model\.safetensors\.index\.json is missing"):
        _load(sharded)


def test_not_a_directory():
    with pytest.raises(LoaderError, match=r"--model /nonexistent/x: not a directory"):
        load_model(EngineConfig(model="/nonexistent/x"))


def test_fused_expert_names_load_like_per_expert(ckpt):
    """Checkpoints with transformers 5's in-memory fused names load to the same banks."""
    _, _, ref = _load(ckpt)

    def fuse(sd):
        for layer in (0, 2):
            p = f"model.layers.{layer}.mlp.experts."
            gate = [sd.pop(f"{p}{e}.gate_proj.weight") for e in range(8)]
            up = [sd.pop(f"{p}{e}.up_proj.weight") for e in range(8)]
            down = [sd.pop(f"{p}{e}.down_proj.weight") for e in range(8)]
            sd[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            sd[p + "down_proj"] = torch.stack(down)
    _rewrite(ckpt, fuse)
    _, _, banks = _load(ckpt)
    for a, b in zip(ref.layers, banks.layers):
        for name in ("gate_up", "down"):
            assert torch.equal(a.tensors[name], b.tensors[name])


def test_progress_callback_reaches_total(ckpt):
    seen = []
    load_checkpoint(ckpt, torch.device("cpu"), torch.float32, progress=seen.append)
    assert seen[-1]["done"] == seen[-1]["total"] and seen[-1]["fraction"] == 1.0
    assert [s["done"] for s in seen] == list(range(1, len(seen) + 1))
