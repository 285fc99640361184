"""Fine-grained FP8 checkpoints and ``--moe-expert-dtype fp8``, end to end on the CPU: every backend's
greedy tokens equal transformers' on the dequantized weights (fp32), FP8 experts stay FP8 in the banks,
and unsupported FP8 variants are refused with one line naming what is supported.

The checkpoint is written by tests/engine/fp8_checkpoints.py (transformers' class, the Hub's layout,
partial blocks, fp32 and bf16 scales)."""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from services.engine.config import EngineConfig  # noqa: E402
from services.engine.models.errors import LoaderError  # noqa: E402
from services.engine.models.loader import read_spec  # noqa: E402
from services.engine.models.registry import load_model  # noqa: E402
from services.engine.moe.banks import ExpertFormat  # noqa: E402
from services.engine.moe.sizing import fmt_bytes  # noqa: E402
from services.engine.preflight import check_fits, check_model  # noqa: E402
from services.engine.runtime.kv_cache import ForwardBatch, KVCache  # noqa: E402
from tests.engine.fp8_checkpoints import block_quantize, qwen3_fp8_model, write_fp8_checkpoint  # noqa: E402
from tests.helpers import graph_greedy, greedy_generate, hf_greedy, hf_last_logits, tolerance  # noqa: E402

PROMPT = [3, 17, 42, 5, 99, 64, 8, 120, 33, 1, 77]
NEW_TOKENS = 12
BACKENDS = {  # every backend, each with a cache small enough that decode misses (2 MoE layers x 8 experts)
    "resident": {},
    "offload": {"moe_cache_size": 4},
    "cpu": {"moe_cache_size": 4, "moe_cpu_threads": 2},
    "hybrid": {"moe_cache_size": 4, "moe_cpu_threads": 2},
    "auto": {"moe_cache_size": 4},
}


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """(checkpoint dir, transformers model on its dequantized weights, its greedy tokens)."""
    model = qwen3_fp8_model()
    d = tmp_path_factory.mktemp("qwen3_fp8")
    write_fp8_checkpoint(model, d)
    return d, model, hf_greedy(model, PROMPT, NEW_TOKENS)


def test_experts_load_as_fp8_blocks(fp8_ckpt):
    d, _, _ = fp8_ckpt
    lm = load_model(EngineConfig(model=str(d)), attach_backend=False)
    layer = lm.banks.layers[0]
    assert layer.format is ExpertFormat.FP8_BLOCK
    assert {n: (t.dtype, tuple(t.shape)) for n, t in layer.tensors.items()} == {
        "gate_up": (torch.float8_e4m3fn, (8, 320, 192)), "down": (torch.float8_e4m3fn, (8, 192, 160)),
        "gate_up_scale": (torch.float32, (8, 4, 2)), "down_scale": (torch.float32, (8, 2, 2))}
    stored = load_file(d / "model.safetensors")
    up = stored["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]  # [2, 2]: up's grid after gate's
    torch.testing.assert_close(lm.banks.layers[1].tensors["gate_up_scale"][5, 2:], up.float(), rtol=0, atol=0)
    assert lm.banks.expert_nbytes() == 3 * 192 * 160 + 4 * (4 * 2 + 2 * 2)  # half of bf16's bytes, plus scales


def test_last_logits_match_transformers(fp8_ckpt):
    d, hf, _ = fp8_ckpt
    lm = load_model(EngineConfig(model=str(d)))
    kv = KVCache(lm.spec, 1, 64, "cpu", torch.float32)
    ours = lm.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), ForwardBatch.single(0, 0, len(PROMPT)), kv)[0]
    assert (ours - hf_last_logits(hf, PROMPT)).abs().max().item() <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_equals_transformers(backend, fp8_ckpt, tmp_path, monkeypatch):
    d, _, want = fp8_ckpt
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))  # auto: no profile, so offload (test_auto.py)
    lm = load_model(EngineConfig(model=str(d), moe_backend=backend, **BACKENDS[backend]))
    tokens = greedy_generate(lm, PROMPT, NEW_TOKENS)
    assert tokens == want
    assert len(set(want)) > 1
    stats = lm.backend.stats()
    if backend in ("cpu", "hybrid"):
        assert stats["cpu_executor"]["routes_computed"] > 0  # the FP8 CPU kernels did part of the work
    if backend != "resident":
        cache = stats.get("cache") or stats["auto"]["inner"]["cache"] if backend == "auto" else stats["cache"]
        assert cache["misses"] > 0 and cache["expert_bytes"] == lm.banks.expert_nbytes()


@pytest.mark.parametrize("backend", ["resident", "cpu"])
def test_online_fp8_equals_transformers_on_quantized_experts(backend, hf_checkpoints):
    """--moe-expert-dtype fp8 on an fp32 checkpoint: the banks become fp8_block and the tokens equal
    transformers' with each expert weight block-quantized and dequantized (this file's own quantizer)."""
    c = hf_checkpoints["qwen3_moe"]
    ref = copy.deepcopy(c.hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e].copy_(block_quantize(p[e], torch.float32)[2])
            elif name.endswith("experts.gate_up_proj"):
                I = p.shape[1] // 2
                for e in range(p.shape[0]):
                    p[e, :I].copy_(block_quantize(p[e, :I], torch.float32)[2])
                    p[e, I:].copy_(block_quantize(p[e, I:], torch.float32)[2])
    extra, events = BACKENDS[backend], []
    lm = load_model(EngineConfig(model=str(c.dir), moe_expert_dtype="fp8", moe_backend=backend, **extra),
                    progress=events.append)
    assert all(layer.format is ExpertFormat.FP8_BLOCK for layer in lm.banks.layers)
    quantizing = [e for e in events if e["phase"] == "quantizing"]
    assert [e["done"] for e in quantizing] == list(range(1, len(lm.banks.layers) + 1))
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == hf_greedy(ref, PROMPT, NEW_TOKENS)


def _variant(src, dst, config=None, drop=None, retype=None):
    """A copy of checkpoint ``src`` with its quantization_config updated, a tensor dropped or re-typed."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {**cfg["quantization_config"], **config}
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop or retype:
        tensors = load_file(dst / "model.safetensors")
        if drop:
            del tensors[drop]
        if retype:
            tensors[retype[0]] = tensors[retype[0]].to(retype[1])
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


SCALE = "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"
REFUSED = {
    "per_tensor": ({"config": {"weight_block_size": None}}, r"without weight_block_size \(per-tensor FP8 scales\)"),
    "static_activations": ({"config": {"activation_scheme": "static"}}, r"activation_scheme 'static'"),
    "e5m2": ({"config": {"fmt": "e5m2"}}, r"fmt 'e5m2'"),
    "other_block": ({"config": {"weight_block_size": [64, 64]}}, r"weight_block_size \[64, 64\]"),
    "other_method": ({"config": {"quant_method": "awq"}}, r"quant_method 'awq'"),
    "missing_scale": ({"drop": SCALE}, r"missing tensor 'model.layers.0.mlp.experts.3.down_proj.weight_scale_inv'"),
    "fp16_scale": ({"retype": (SCALE, torch.float16)}, r"has dtype torch.float16 \(supported: float32 or bfloat16"),
    "attn_without_scale": ({"drop": "model.layers.0.self_attn.o_proj.weight_scale_inv"},
                           r"o_proj.weight' is float8_e4m3fn without a 'model.layers.0.self_attn.o_proj.weight_scale_inv'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_fp8_variants_are_refused(case, fp8_ckpt, tmp_path):
    change, message = REFUSED[case]
    d = _variant(fp8_ckpt[0], tmp_path / case, **change)
    with pytest.raises(LoaderError, match=message) as err:
        load_model(EngineConfig(model=str(d)), attach_backend=False)
    if "config" in change:
        assert "supported: fine-grained FP8" in str(err.value) and "config.json" in str(err.value)


@pytest.mark.parametrize("expert_dtype", ["checkpoint", "fp8"])
def test_preflight_counts_experts_in_their_format(expert_dtype, fp8_ckpt, hf_checkpoints):
    """The fail-fast memory check counts FP8 experts at FP8 size (an FP8 checkpoint), and at the load's
    peak, the checkpoint's own format, when quantizing at load."""
    fp8_dir, bf_dir = fp8_ckpt[0], hf_checkpoints["qwen3_moe"].dir
    for model, per_expert in ((fp8_dir, 3 * 192 * 160 + 4 * (4 * 2 + 2 * 2)), (bf_dir, 3 * 64 * 32 * 4)):
        spec = read_spec(model)
        config = EngineConfig(model=str(model), moe_expert_dtype=expert_dtype)
        with pytest.raises(ValueError) as err:
            check_fits(spec, config, torch.device("cpu"), host_available=1)
        total = spec.num_moe_layers * spec.num_experts * per_expert
        assert f"experts {fmt_bytes(total)}" in str(err.value)


def test_preflight_refuses_an_unsupported_fp8_variant(fp8_ckpt, tmp_path):
    d = _variant(fp8_ckpt[0], tmp_path / "static", config={"activation_scheme": "static"})
    with pytest.raises(LoaderError, match="activation_scheme 'static'"):
        check_model(EngineConfig(model=str(d)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["resident", "offload", "hybrid"])
def test_cuda_backends_equal_transformers(backend, fp8_ckpt):
    """On CUDA (fp32): the Triton FP8 kernels (resident, offload, hybrid's GPU part) and the fused miss copy
    of all four banks give transformers' greedy tokens; resident also through the captured decode graph."""
    d, _, want = fp8_ckpt
    lm = load_model(EngineConfig(model=str(d), device="cuda", moe_backend=backend, **BACKENDS[backend]))
    assert lm.backend.stats().get("decode_kernel", "triton") == "triton"
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == want
    assert lm.backend.stats().get("decode_kernel", "triton") == "triton"  # no silent fallback to torch
    if backend == "resident":
        assert graph_greedy(lm, "resident", PROMPT, NEW_TOKENS) == want


def test_expert_dtype_dtype_dequantizes_fp8_experts(fp8_ckpt):
    """--moe-expert-dtype dtype on an FP8 checkpoint: plain fp32 banks, each expert its FP8 weight times its
    block scales, and transformers' greedy tokens."""
    from services.engine.moe.fp8 import dequantize, dequantize_gate_up

    d, _, want = fp8_ckpt
    lm = load_model(EngineConfig(model=str(d), moe_expert_dtype="dtype"))
    native = load_model(EngineConfig(model=str(d)), attach_backend=False)
    lb, nb = lm.banks.layers[0], native.banks.layers[0].tensors
    assert lb.format is ExpertFormat.UNQUANTIZED and set(lb.tensors) == {"gate_up", "down"}
    assert torch.equal(lb.tensors["gate_up"], dequantize_gate_up(nb["gate_up"], nb["gate_up_scale"]))
    assert torch.equal(lb.tensors["down"], dequantize(nb["down"], nb["down_scale"]))
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == want
