"""Synthetic models: presets build in memory, generate, and are deterministic for a seed."""

from __future__ import annotations

import re

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.errors import LoaderError
from services.engine.models.registry import load_model
from services.engine.models.synthetic import pad_word, synthetic_spec
from services.engine.runtime.kv_cache import ForwardBatch, KVCache
from services.engine.runtime.sampler import Sampler, SamplingParams, make_generator
from tests.helpers import greedy_generate


def test_tiny_builds_and_generates():
    lm = load_model(EngineConfig(model="synthetic:tiny"))
    assert lm.model_id == "synthetic:tiny"
    assert (lm.model_dir / "tokenizer.json").is_file() and (lm.model_dir / "generation_config.json").is_file()
    assert lm.spec.num_moe_layers == 2 and lm.spec.num_experts == 8
    out = greedy_generate(lm, [1, 2, 3, 4], 8)
    assert len(out) == 8 and all(0 <= t < lm.spec.vocab_size for t in out)
    again = greedy_generate(load_model(EngineConfig(model="synthetic:tiny")), [1, 2, 3, 4], 8)
    assert again == out  # same seed, same weights
    other = load_model(EngineConfig(model="synthetic:tiny", seed=1))
    assert not torch.equal(other.banks.layers[0].tensors["down"], lm.banks.layers[0].tensors["down"])


def test_layers_override_and_bf16():
    lm = load_model(EngineConfig(model="synthetic:tiny?layers=3", dtype="bfloat16"))
    assert lm.spec.num_layers == 3 and len(lm.banks.layers) == 3
    assert lm.banks.layers[0].tensors["gate_up"].dtype == torch.bfloat16
    assert len(greedy_generate(lm, [5, 6, 7], 4)) == 4


def test_weights_have_the_intended_scale():
    lm = load_model(EngineConfig(model="synthetic:tiny"))
    std = lm.banks.layers[0].tensors["gate_up"].std().item()
    assert 0.015 < std < 0.025
    # the routing-relevant scales of the module docstring (tiny: D=64, L=2)
    assert 0.45 < lm.model.model.embed_tokens.weight.std().item() < 0.55
    assert 0.1 < lm.model.model.layers[0].mlp.gate.weight.std().item() < 0.15  # 1/sqrt(64)
    assert 0.008 < lm.banks.layers[0].tensors["down"].std().item() < 0.012  # 0.02/sqrt(2*2)
    assert torch.equal(lm.model.model.norm.weight, torch.ones_like(lm.model.model.norm.weight))


def test_real_geometries():
    spec = synthetic_spec("synthetic:qwen3-30b-a3b", tokenizer_vocab=0)
    assert (spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
            48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    assert spec.expert_nbytes(torch.bfloat16) == 9_437_184  # the 9.4 MB of docs/design.md §6
    # ~3.3 B active parameters per token (Qwen3-30B-A3B's "A3B")
    assert 3.0e9 < spec.active_weight_nbytes(torch.bfloat16) / 2 < 3.6e9
    mix = synthetic_spec("synthetic:mixtral-8x7b", tokenizer_vocab=0)
    assert (mix.num_layers, mix.num_experts, mix.top_k, mix.moe_intermediate_size) == (32, 8, 2, 14336)
    assert mix.traits.expert_proj == ("w1", "w3", "w2")


@pytest.mark.parametrize("name, layers, experts, active_b", [("gpt-oss-20b", 24, 32, (3.4, 3.8)),
                                                           ("gpt-oss-120b", 36, 128, (4.9, 5.3))])
def test_gpt_oss_geometries(name, layers, experts, active_b):
    """openai/gpt-oss-*: config.json geometry; ~3.6 B / ~5.1 B active parameters per token (their model cards)."""
    spec = synthetic_spec(f"synthetic:{name}", tokenizer_vocab=0)
    assert (spec.model_type, spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
            "gpt_oss", layers, experts, 4, 2880, 2880, 64, 8, 64, 201088)
    assert spec.layer_windows == (128, None) * (layers // 2)  # sliding first, then full, alternating
    assert spec.expert_bias and spec.expert_activation.limit == 7.0 and spec.rope_scaling["factor"] == 32.0
    assert active_b[0] < spec.active_weight_nbytes(torch.bfloat16) / 2 / 1e9 < active_b[1]
    cut = synthetic_spec(f"synthetic:{name}?layers=3", tokenizer_vocab=0)
    assert cut.num_layers == 3 and cut.layer_windows == (128, None, 128)


def test_gpt_oss_builds_with_bias_banks(monkeypatch):
    """The gpt-oss builder path (bias banks zeroed, clamped activation on the banks, router named 'router')
    at a small width: the real presets differ only in their sizes."""
    from services.engine.models import synthetic

    small = dict(synthetic.PRESETS["gpt-oss-20b"], num_hidden_layers=2, num_local_experts=8, hidden_size=64,
                 intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=None,
                 sliding_window=4)
    monkeypatch.setitem(synthetic.PRESETS, "gpt-oss-small", small)
    lm = load_model(EngineConfig(model="synthetic:gpt-oss-small"))
    layer = lm.banks.layers[0]
    assert torch.equal(layer.tensors["down_bias"], torch.zeros_like(layer.tensors["down_bias"]))
    assert lm.banks.activation.limit == 7.0 and not lm.banks.plain_swiglu
    assert 0.1 < lm.model.model.layers[0].mlp.router.weight.std().item() < 0.15  # 1/sqrt(64)
    assert len(greedy_generate(lm, [1, 2, 3, 4, 5, 6], 6)) == 6


def test_gpt_oss_presets_build_mxfp4_experts(monkeypatch):
    """gpt-oss presets hold MXFP4 experts like the Hub's (what offload / hybrid benchmarks then move and the
    CPU reads): N(0, std) values quantized per 32, so dequantized they keep the init's scale; the real
    presets' size check counts 4.25 bits per weight; --moe-expert-dtype dtype gives the plain banks."""
    from services.engine.models import mxfp4, synthetic
    from services.engine.moe.banks import ExpertFormat, expert_nbytes
    from services.engine.moe.sizing import fmt_bytes
    from services.engine.preflight import check_fits

    small = dict(synthetic.PRESETS["gpt-oss-20b"], num_hidden_layers=2, num_local_experts=8, hidden_size=128,
                 intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=None,
                 sliding_window=4)
    monkeypatch.setitem(synthetic.PRESETS, "gpt-oss-small", small)
    lm = load_model(EngineConfig(model="synthetic:gpt-oss-small"))
    t = lm.banks.layers[0].tensors
    assert lm.banks.layers[0].format is ExpertFormat.MXFP4 and t["gate_up"].shape == (8, 128, 64)
    gate_up = mxfp4.dequantize_rows(t["gate_up"], t["gate_up_scale"])
    down = mxfp4.dequantize_rows(t["down"], t["down_scale"])
    assert 0.017 < gate_up.std().item() < 0.023
    assert 0.0085 < down.std().item() < 0.0115  # 0.02 / sqrt(2 * 2)
    plain = load_model(EngineConfig(model="synthetic:gpt-oss-small", moe_expert_dtype="dtype"))
    assert plain.banks.layers[0].format is ExpertFormat.UNQUANTIZED
    spec = synthetic_spec("synthetic:gpt-oss-120b", tokenizer_vocab=0)
    mx = 36 * 128 * 3 * 2880 * 2880 * 17 // 32  # ~61 GB of MXFP4, not ~229 GB of bf16
    with pytest.raises(ValueError, match=re.escape(f"experts {fmt_bytes(mx)}")):
        check_fits(spec, EngineConfig(model="synthetic:gpt-oss-120b", dtype="bfloat16", moe_backend="hybrid"),
                   torch.device("cpu"), host_available=1)
    assert expert_nbytes(ExpertFormat.MXFP4, 2880, 2880, torch.bfloat16) == 3 * 2880 * 2880 * 17 // 32


@pytest.mark.parametrize("model, match", [
    ("synthetic:nope", r"unknown synthetic preset 'nope' \(presets: tiny, qwen3-30b-a3b, qwen3-moe-mini, mixtral-8x7b, "
                       r"gpt-oss-20b, gpt-oss-120b\)"),
    ("synthetic:tiny?layers=x", r"layers must be a positive integer, got 'x'"),
    ("synthetic:tiny?layers=0", r"layers must be a positive integer, got '0'"),
    ("synthetic:tiny?seed=-1", r"seed must be a non-negative integer, got '-1'"),
    ("synthetic:tiny?routing=zipf", r"routing='zipf': expected one of uniform, sticky, moderate, flat or file:PATH"),
    ("synthetic:tiny?depth=2", r"unknown option 'depth' \(options: layers=N, routing="),
])
def test_bad_names(model, match):
    with pytest.raises(LoaderError, match=match):
        load_model(EngineConfig(model=model))


def test_large_vocab_preset_gets_a_tokenizer_that_decodes_every_id(monkeypatch, tmp_path):
    from services.common.tokenizer import Tokenizer
    from services.engine.models.synthetic import tokenizer_dir

    monkeypatch.setenv("TANDEM_DEMO_DIR", str(tmp_path / "demo"))
    tok = Tokenizer.from_dir(tokenizer_dir("synthetic:mixtral-8x7b"))
    ids = [0, 500, 31999]  # 31999 lies far past the demo tokenizer's ~700 trained tokens
    assert all(tok.decode([i]) for i in ids)
    assert tok.decode([31999]) == pad_word(31999)


def test_padded_tokenizer_adds_no_added_tokens_and_round_trips(monkeypatch, tmp_path):
    """The padding lives in the BPE vocabulary: llguidance (grammar masks, built at start) takes quadratic
    time in added tokens with the GIL held (151k of them froze start-up for minutes). Padding words come
    back to their ids when re-encoded, and the demo vocabulary's text encodes as it did unpadded."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from services.engine.models.demo import write_tokenizer_files
    from services.engine.models.synthetic import tokenizer_dir

    monkeypatch.setenv("TANDEM_DEMO_DIR", str(tmp_path / "demo"))
    padded_dir = tokenizer_dir("synthetic:qwen3-30b-a3b")
    write_tokenizer_files(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "tokenizer.json").read_text())
    padded = json.loads((padded_dir / "tokenizer.json").read_text())
    assert padded["added_tokens"] == plain["added_tokens"]
    tok = HFTokenizer.from_file(str(padded_dir / "tokenizer.json"))
    base = HFTokenizer.from_file(str(tmp_path / "plain" / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 151936
    ids = [base.get_vocab_size(), 5000, 77777, 151935]
    text = tok.decode(ids)
    assert text == "".join(pad_word(i) for i in ids)
    assert tok.encode(text).ids == ids
    prose = "Tandem serves a mixture-of-experts model: the forward graphics processor, 2024's questions!"
    assert tok.encode(prose).ids == base.encode(prose).ids


def _decode_routes(lm, n: int, sampling: SamplingParams) -> tuple[list[int], dict[int, list[list[int]]], list[float]]:
    """(n decoded tokens, {MoE layer: topk_ids row per decode token}, renormalized top-1 weights) with the
    engine's own forward, KVCache and Sampler; the routes are counted by wrapping the backend's forward."""
    routes: dict[int, list[list[int]]] = {}
    top1: list[float] = []
    backend = lm.model.backend
    forward = backend.forward

    def counting_forward(moe_layer, hidden, topk_ids, topk_weights):  # [T, D], [T, A], [T, A]
        if hidden.shape[0] == 1:  # decode steps only (the prefill has the whole prompt)
            routes.setdefault(moe_layer, []).append(topk_ids[0].tolist())
            top1.append(float(topk_weights[0].max()))
        return forward(moe_layer, hidden, topk_ids, topk_weights)

    backend.forward = counting_forward
    try:
        prompt = list(range(100, 140))
        kv = KVCache(lm.spec, 1, len(prompt) + n, lm.device, lm.dtype)
        sampler, gen = Sampler(), make_generator(0, lm.device)
        logits = lm.model(torch.tensor(prompt), torch.arange(len(prompt)), ForwardBatch.single(0, 0, len(prompt)), kv)
        out: list[int] = []
        for step in range(n):
            out.append(sampler(logits, [sampling], [gen])[0])
            pos = len(prompt) + step
            logits = lm.model(torch.tensor([out[-1]]), torch.tensor([pos]), ForwardBatch.single(0, pos, 1), kv)
    finally:
        del backend.forward  # back to the class's method
    return out, routes, top1


def _miss_proxy(rows: list[list[int]], E: int) -> float:
    """Share of routes whose expert is outside the first E/3 distinct experts seen (a cache holding a
    third of the experts that never evicts)."""
    flat = [e for row in rows for e in row]
    first: list[int] = []
    for e in flat:
        if e not in first and len(first) < E // 3:
            first.append(e)
    return sum(e not in first for e in flat) / len(flat)


@pytest.mark.parametrize("model, dtype, n", [
    ("synthetic:qwen3-moe-mini", "float32", 64),
    pytest.param("synthetic:qwen3-30b-a3b?layers=2", "bfloat16", 128, marks=pytest.mark.slow),  # ~1 min
])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_tokens=128),
                                      SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=128)],
                         ids=["greedy", "sampled"])
def test_decode_routing_is_diverse(model, dtype, n, sampling):
    """Random weights must route like a real MoE (Qwen3-30B-A3B decode touches most of its 128 experts
    per layer within a few hundred tokens; a third of the experts cached misses ~40-60%), or offload
    and hybrid benchmarks on synthetic models measure nothing. ``-s`` prints the numbers of the
    synthetic.py docstring."""
    lm = load_model(EngineConfig(model=model, dtype=dtype))
    E, A = lm.spec.num_experts, lm.spec.top_k
    out, routes, top1 = _decode_routes(lm, n, sampling)
    assert len(routes) == lm.spec.num_moe_layers and all(len(rows) == n for rows in routes.values())
    for layer, rows in sorted(routes.items()):
        unique, proxy = len({e for row in rows for e in row}), _miss_proxy(rows, E)
        print(f"{model} {'greedy' if sampling.greedy else 'sampled'} layer {layer}: {unique}/{E} experts, "
              f"1/3-cache miss proxy {proxy:.2f}, distinct tokens {len(set(out))}/{n}")
        assert unique >= 0.8 * E, f"layer {layer}: only {unique} of {E} experts touched in {n} decode tokens"
        assert 0.3 <= proxy <= 0.7, f"layer {layer}: miss proxy {proxy:.2f} outside [0.3, 0.7]"
    assert len(set(out)) >= n // 2, f"decode loops on a few tokens: {len(set(out))} distinct of {n}"
    # router weights neither uniform (1/A each) nor one-hot
    mean_top1 = sum(top1) / len(top1)
    assert 1.2 / A < mean_top1 < 0.6, f"mean renormalized top-1 router weight {mean_top1:.2f}"
