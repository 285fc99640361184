"""Synthetic models: random weights made in memory with a real model's geometry
(``--model synthetic:NAME[?layers=N&routing=R&seed=N&experts=TYPE]``), so benchmarks need no checkpoint on
disk. ``routing=sticky|moderate|flat|file:PATH`` makes them route like real model families (routing_presets.py,
docs/routing.md); the init below is what ``uniform``, the default, measures. ``experts=TYPE`` keeps the experts
in GGUF blocks (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf, or llama.cpp's q4_K_M / q5_K_M mixes: models/gguf_random.py),
random valid blocks of the same spread as the float init below.

Presets are a table of Hugging Face config dicts; they go through the same ModelSpec.from_hf_config
as a real checkpoint. Weights are filled in place bank by bank and layer by layer (no full-size
temporaries). On CUDA each bank is generated on the GPU (H200: ~1 TB/s of random numbers) and copied
into the host bank, or kept on the GPU when the banks are to live there anyway (``banks_device``, the
resident backend): the 60 GB of Qwen3-30B-A3B then build in seconds.

Init (``param_std``; norms 1, biases 0) — a plain random init chosen so decode *routes* like a real
MoE, since offload/hybrid benchmarks on these models measure nothing otherwise:
  - every matrix N(0, 0.02) (HF's initializer_range), expert gate_up included;
  - residual-branch outputs (o_proj, down_proj, expert ``down``) N(0, 0.02 / sqrt(2 L)) (GPT-2's
    scaled init): the summed branches stay the same size whatever the depth, so ``?layers=N`` cuts
    route like the full model;
  - embeddings N(0, 0.5), so the current token stays visible in the residual stream of every layer;
  - router N(0, 1 / sqrt(D)) (LeCun): logits ~N(0, 1) on the normed input, renormalized top-1
    weight ~0.24 of top-8 (neither uniform nor one-hot).
Why: the old init (everything 0.02, router 0.2) gave a 1/3 expert cache a 0.000 miss rate on the H200.
With embeddings of RMS 0.02 against O(1) attention outputs, the stream is the attention average of
the context: router inputs of consecutive tokens had cos 0.85, 75% of their energy in one constant
direction, so the second layer touched 40 of 128 experts in 128 tokens, greedy decode looped on a
few tokens and the router (logit std 9) was near one-hot (top-1 softmax 0.73-0.93). Embeddings at
N(0, 1) without the depth scaling still collapse past a few layers (the context mean feeds itself
through attention); with the depth scaling, N(0, 1) makes every layer route at random (miss ~0.70),
N(0, 0.5) leaves deep layers some of the temporal locality real decode has.
Measured (CPU, 128 decode tokens, greedy and temperature 0.7/top_p 0.8/top_k 20; "proxy" = share of
routes outside the first 1/3 experts seen, "LRU" = miss rate of an LRU cache of E/3):
  qwen3-30b-a3b?layers=2, bf16     old: 83 and 41/128 experts (L0, L1), proxy 0.41 / 0.00,
                                        greedy 41 distinct tokens of 128
                                   new: 128/128 experts, proxy 0.55-0.65, LRU 0.68-0.70, 128 tokens
  ?layers=24 / 48 (I cut to 96 / 48, expert down std raised to keep its output size)
                                   new: 117-128/128 experts, proxy 0.40-0.65, LRU 0.51-0.72 (falls
                                        with depth)
  qwen3-moe-mini (4 layers, fp32)  old: 19-40/128 experts, proxy 0.00; new: 125-127, proxy 0.57-0.62
Reproduce: ``.venv/bin/python -m pytest tests/engine/models/test_synthetic.py -s -k routing``
(add ``-m slow`` for the layers=2 real-width cut). A preset that ties its embeddings would make
lm_head N(0, 0.5) and decode echo its input: none does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs

import torch
from tqdm import tqdm

from services.common.logging import get_logger
from services.engine.models.causal_lm import MoECausalLM
from services.engine.models.errors import LoaderError
from services.engine.models import gguf_random, mxfp4
from services.engine.models.loader import build_empty_model
from services.engine.models.quant_config import checkpoint_format
from services.engine.models.spec import ModelSpec
from services.engine.moe import routing_presets
from services.engine.moe.banks import (GGUF_TYPES, ExpertBanks, ExpertFormat, LayerBanks, bank_shapes, check_geometry,
                                       gguf_format)
from services.engine.moe.gguf_quant import row_bytes as gguf_row_bytes
from services.engine.moe.routing_presets import SyntheticRouting

log = get_logger("synthetic")

PREFIX = "synthetic:"
INIT_STD = 0.02  # Hugging Face's initializer_range: every matrix not named below, and the experts' gate_up
EMBED_STD = 0.5  # token embeddings: the token stays visible in every layer's stream (docstring)
ROUTER_LOGIT_STD = 1.0  # router N(0, ROUTER_LOGIT_STD / sqrt(D)): logits ~N(0, 1) on the normed input
TOKENIZER_LAYOUT = 2  # the padded tokenizer's layout (its cache dir's suffix): 2 = padding in the BPE vocabulary
RESIDUAL_SCALED = True  # GPT-2's scaled init: o_proj / down_proj / expert down std INIT_STD / sqrt(2 L)

_GPT_OSS = dict(model_type="gpt_oss", num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128,
                attention_bias=True, rms_norm_eps=1e-5, swiglu_alpha=1.702, swiglu_limit=7.0,
                max_position_embeddings=131072,
                # experts in MXFP4 like the Hub checkpoints' (the bytes offload / hybrid move and the CPU reads)
                quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})

PRESETS: dict[str, dict] = {
    # vocab_size None = the demo tokenizer's vocabulary, so generated ids decode to text.
    "tiny": dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                 hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=None, norm_topk_prob=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                          hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=40960),
    # Qwen3-30B-A3B's routing geometry (E=128, top-8) at an eighth of the width: CPU tests of routing.
    "qwen3-moe-mini": dict(model_type="qwen3_moe", num_hidden_layers=4, num_experts=128, num_experts_per_tok=8,
                           hidden_size=256, moe_intermediate_size=96, intermediate_size=768,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000,
                           norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "mixtral-8x7b": dict(model_type="mixtral", num_hidden_layers=32, num_local_experts=8, num_experts_per_tok=2,
                         hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, rope_theta=1000000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=32768),
    # gpt-oss (openai/gpt-oss-*/config.json): alternating sliding (128) / full attention layers, sinks, YaRN,
    # expert biases and the clamped SwiGLU; MXFP4 experts (N(0, std) weights quantized per 32 values, as the
    # Hub's are stored; --moe-expert-dtype dtype dequantizes them).
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128),
}


def is_synthetic(model: str) -> bool:
    return model.startswith(PREFIX)


OPTIONS = "layers=N, routing=uniform|sticky|moderate|flat|file:PATH, seed=N, experts=TYPE"


def parse_options(model: str) -> tuple[str, dict[str, str]]:
    """'synthetic:NAME[?layers=N&routing=R&seed=N&experts=TYPE]' -> (NAME, its options as given)."""
    name, _, query = model[len(PREFIX):].partition("?")
    if name not in PRESETS:
        raise LoaderError(f"--model {model}: unknown synthetic preset {name!r} (presets: {', '.join(PRESETS)})")
    try:
        pairs = parse_qs(query, strict_parsing=bool(query))
    except ValueError:
        raise LoaderError(f"--model {model}: options must read key=value&... ({OPTIONS})") from None
    options = {key: values[-1] for key, values in pairs.items()}
    for key, value in options.items():
        if key not in ("layers", "routing", "seed", "experts"):
            raise LoaderError(f"--model {model}: unknown option {key!r} (options: {OPTIONS})")
        if key in ("layers", "seed") and not (value.isdigit() and (int(value) > 0 or key == "seed")):
            raise LoaderError(f"--model {model}: {key} must be a {'positive' if key == 'layers' else 'non-negative'} "
                              f"integer, got {value!r}")
    gguf_types = gguf_random.SINGLE_TYPES + tuple(gguf_random.MIXES)
    if options.get("experts", gguf_types[0]) not in gguf_types:
        raise LoaderError(f"--model {model}: experts must be one of {', '.join(gguf_types)}, got {options['experts']!r}")
    if options.get("routing", "uniform").partition(":")[0] not in (*routing_presets.NAMES, "file"):
        raise LoaderError(f"--model {model}: routing={options['routing']!r}: expected one of "
                          f"{', '.join(routing_presets.NAMES)} or file:PATH")
    return name, options


def parse_name(model: str) -> tuple[str, dict]:
    """'synthetic:NAME[?layers=N...]' -> (NAME, overrides of the preset config)."""
    name, options = parse_options(model)
    return name, ({"num_hidden_layers": int(options["layers"])} if "layers" in options else {})


def synthetic_routing(model: str, spec: ModelSpec, device: torch.device) -> SyntheticRouting | None:
    """The model's routing preset (``routing=``, its process seeded by ``seed=``, default 0), or None for
    ``uniform``: the router's own top-k."""
    _, options = parse_options(model)
    value, seed = options.get("routing", "uniform"), int(options.get("seed", 0))
    tables = routing_presets.parse(value, spec.num_moe_layers, spec.num_experts, seed)
    if tables is None:
        return None
    return SyntheticRouting(tables, value, seed, spec.top_k, spec.renormalize, device)


def expert_formats(model: str, spec: ModelSpec) -> list[ExpertFormat]:
    """Per MoE layer, the bank format of synthetic model ``model`` (LoaderError when its geometry cannot
    hold the GGUF type asked for)."""
    experts = parse_options(model)[1].get("experts")
    if experts is None:
        return [checkpoint_format(spec.extra, f"synthetic preset {model!r}")] * spec.num_moe_layers
    formats = [gguf_format(gu, dn) for gu, dn in gguf_random.layer_types(experts, spec.num_moe_layers)]
    for fmt in dict.fromkeys(formats):
        try:
            check_geometry(fmt, spec.hidden_size, spec.moe_intermediate_size)
        except ValueError as e:
            raise LoaderError(f"--model {model}: {e}") from None
    return formats


def synthetic_spec(model: str, tokenizer_vocab: int) -> ModelSpec:
    name, overrides = parse_name(model)
    cfg = {**PRESETS[name], **overrides}
    if cfg.get("vocab_size") is None:
        cfg["vocab_size"] = tokenizer_vocab
    return ModelSpec.from_hf_config(cfg, source=f"synthetic preset {name!r}")


def _fill_(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``t`` in place with N(0, std) drawn on the generator's device (staged through one
    temporary of t's size when the devices differ)."""
    if t.device.type == gen.device.type:  # one GPU: cuda and cuda:0 are the same device
        t.normal_(0.0, std, generator=gen)
    else:
        stage = torch.empty(t.shape, dtype=t.dtype, device=gen.device)
        stage.normal_(0.0, std, generator=gen)
        t.copy_(stage)  # synchronous: the stage is freed on return


MXFP4_CHUNK_VALUES = 1 << 26  # values drawn and quantized at a time: ~1.5 GB of fp32 temporaries


def _fill_mxfp4_(packed: torch.Tensor, scales: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill mxfp4 banks packed [E, R, C/2] / scales [E, R, C/32] in place with N(0, std) values quantized
    per 32 (models/mxfp4.py), drawn on the generator's device a few experts at a time."""
    E, R, half = packed.shape
    step = max(1, MXFP4_CHUNK_VALUES // (R * 2 * half))
    for e in range(0, E, step):
        n = min(step, E - e)
        w = torch.empty((n, R, 2 * half), dtype=torch.float32, device=gen.device).normal_(0.0, std, generator=gen)
        q, sc = mxfp4.quantize_rows(w)
        packed[e:e + n].copy_(q)
        scales[e:e + n].copy_(sc)


def param_std(name: str, spec: ModelSpec) -> float:
    """Standard deviation of the N(0, std) init of the matrix ``name`` (a Hub parameter name, or
    ``experts.<bank>`` for an expert bank)."""
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD
    if name.endswith((".gate.weight", ".router.weight")):  # router; ".gate_proj" does not match
        return ROUTER_LOGIT_STD / spec.hidden_size ** 0.5
    if RESIDUAL_SCALED and name.endswith(("o_proj.weight", "down_proj.weight", "experts.down", "w2.weight")):
        return INIT_STD / (2 * spec.num_layers) ** 0.5
    return INIT_STD


def build_synthetic(model: str, tokenizer_vocab: int, device: torch.device, dtype: torch.dtype, seed: int,
                    banks_device: torch.device | None = None, progress: Callable[[dict], None] | None = None,
                    ) -> tuple[ModelSpec, MoECausalLM, ExpertBanks]:
    """(spec, model on ``device``, banks on ``banks_device`` — host by default) with random weights.
    ``progress`` gets ``{"phase": "building", "done": n, "total": N, "fraction": f}`` per MoE layer.

    Deterministic for (model, seed, device kind): the generator lives on CUDA when ``device`` is
    CUDA, on the CPU otherwise.
    """
    spec = synthetic_spec(model, tokenizer_vocab)
    device = torch.device(device)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    net = build_empty_model(spec, device, dtype)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                _fill_(p, param_std(name, spec), gen)
        D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
        formats = expert_formats(model, spec)
        total = spec.num_moe_layers
        if banks_device is None:
            # host banks of a CUDA model are pinned before they are filled (an offloading backend pins them
            # anyway): the GPU-made weights then come down by DMA at PCIe speed, not through pageable staging
            banks = ExpertBanks.allocate(formats, total, E, D, I, dtype, pin=device.type == "cuda",
                                         bias=spec.expert_bias, activation=spec.expert_activation)
        else:
            shapes = bank_shapes(formats, D, I, dtype, spec.expert_bias)
            banks = ExpertBanks([LayerBanks(fmt, {name: torch.empty((E, *shape), dtype=dt, device=banks_device)
                                                  for name, (shape, dt) in shapes.items()})
                                 for fmt in formats], spec.expert_activation)
        for n, layer in enumerate(tqdm(banks.layers, desc=f"building {model}", unit="layer", leave=False)):
            fmt = layer.format
            for name, t in layer.tensors.items():
                if name.endswith("_bias"):  # biases 0, like every other bias here
                    t.zero_()
                elif fmt in GGUF_TYPES:  # random blocks of the float init's spread; a wider row's rest zero
                    qtype = GGUF_TYPES[fmt][0 if name == "gate_up" else 1]
                    used = gguf_row_bytes(qtype, D if name == "gate_up" else I)
                    t[..., used:].zero_()
                    gguf_random.random_blocks_(t[..., :used], qtype, param_std(f"experts.{name}", spec), gen)
                elif fmt is ExpertFormat.MXFP4:
                    if not name.endswith("_scale"):  # the scale banks are written with their weights
                        _fill_mxfp4_(t, layer.tensors[name + "_scale"], param_std(f"experts.{name}", spec), gen)
                else:
                    _fill_(t, param_std(f"experts.{name}", spec), gen)
            if progress is not None:
                progress({"phase": "building", "done": n + 1, "total": total, "fraction": (n + 1) / total})
    routing = synthetic_routing(model, spec, device)
    if routing is not None:
        net.set_routing(routing)
    log.info("built %s: %d layers (%d MoE), E=%d, A=%d, %.1f GB of experts on %s, routing %s", model, spec.num_layers,
             spec.num_moe_layers, E, spec.top_k, banks.total_nbytes() / 1e9, banks_device or "cpu",
             routing.name if routing is not None else "uniform (the router's own)")
    return spec, net, banks


def tokenizer_dir(model: str) -> Path:
    """A directory with the demo tokenizer files (model_dir of every synthetic model). A preset whose
    vocabulary is larger than the demo tokenizer's (qwen3-30b-a3b: 151936) gets the tokenizer's BPE
    vocabulary padded up to that size (``_pad_vocab``), so every id the model samples decodes to text and
    the client sees one SSE event per token (what the decode benchmark times)."""
    from services.engine.models.demo import default_demo_dir, write_tokenizer_files

    name, overrides = parse_name(model)
    vocab_size = {**PRESETS[name], **overrides}.get("vocab_size")
    d = default_demo_dir().parent / f"synthetic-tokenizer-{vocab_size or 'demo'}-v{TOKENIZER_LAYOUT}"
    if (d / "generation_config.json").is_file():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".synthetic-tokenizer.tmp-", dir=d.parent))
    write_tokenizer_files(tmp)
    if vocab_size:
        _pad_vocab(tmp / "tokenizer.json", vocab_size)
    try:
        os.rename(tmp, d)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def pad_word(token_id: int) -> str:
    """The padding token of ``token_id`` as it decodes: " zq" and the id in base 26 (letters only, so the
    byte-level pre-tokenizer keeps it one word and the BPE finds it whole when the text comes back)."""
    letters = ""
    while True:
        token_id, r = divmod(token_id, 26)
        letters = chr(ord("a") + r) + letters
        if token_id == 0:
            return " zq" + letters


def _pad_vocab(path: Path, vocab_size: int) -> None:
    """Pad the BPE vocabulary of tokenizer.json up to ``vocab_size`` ids with ``pad_word`` tokens.

    Why in the BPE vocabulary and not as added tokens (the first layout): llguidance's tokenizer (the
    grammar masks, built at start on a side thread) takes quadratic time in the number of added tokens
    and holds the GIL meanwhile. With 151k added tokens that froze the whole process for 2.5-3 minutes of
    start-up on the H200 host (the resident log's gap before its warm-up, hybrid's "kernels warmed in
    156 s"); as vocabulary entries it takes ~1 s, like a real Qwen3 tokenizer. ``ignore_merges``: a word
    found whole in the vocabulary is its token, so a generated padding word re-encodes to its own id (the
    demo vocabulary's words encode as before: docs checked in tests)."""
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    start = max([*vocab.values(), *(t["id"] for t in tok["added_tokens"])]) + 1
    space = "\u0120"  # the byte-level alphabet's space (GPT-2's bytes_to_unicode)
    for i in range(start, vocab_size):
        vocab[space + pad_word(i)[1:]] = i
    tok["model"]["ignore_merges"] = True
    path.write_text(json.dumps(tok, ensure_ascii=False) + "\n", encoding="utf-8")
