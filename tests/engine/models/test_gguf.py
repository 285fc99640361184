"""GGUF models end to end on the CPU (fp32): tiny files in llama.cpp's layout (tests/engine/gguf_checkpoints.py)
whose experts stay in their GGUF types in the banks; every backend's greedy tokens equal transformers'.

References (independent of the engine's loader):
- qwen3moe, qwen2moe: transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``, which reads
  the file and dequantizes every tensor with the gguf package). transformers 5.24's GGUF config mapping
  for these architectures does not read ``expert_feed_forward_length`` (it would build 768-wide experts),
  so the reference gets the model's config; its weights come from the file.
- gpt-oss, olmoe, mixtral: transformers' GGUF loader does not read them (gpt-oss: its processor expects
  ``ffn_*_projs``, not llama.cpp's expert tensors; olmoe: no GGUF mapping; llama: its mapping has no
  experts), so the reference is the transformers model with every tensor replaced by the file's,
  dequantized by the gguf package, Mixtral's q/k permutation undone by transformers' LlamaTensorProcessor
  (``dequantized_reference``).

Expert types: qwen3moe a Q4_K_M-like mix (layer 0 gate/up q4_K + down q6_K, layer 1 all q4_K: per-layer
formats sharing the widest rows); qwen2moe q5_K + q6_K and q8_0 (with its shared expert); gpt-oss mxfp4;
olmoe q8_0 (clip_qkv); mixtral (GGUF 'llama', q/k permuted) q6_K and q5_K + q6_K.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.errors import LoaderError
from services.engine.models.registry import build_backend, load_model
from services.engine.moe.banks import ExpertFormat
from services.engine.moe.gguf_quant import q8_inputs
from services.engine.runtime.kv_cache import ForwardBatch, KVCache
from tests.engine.conftest import _randomize_
from tests.engine.gguf_checkpoints import dequantized_reference, write_gguf
from tests.helpers import greedy_generate, hf_greedy, hf_last_logits, tolerance

PROMPT = [3, 17, 42, 5, 99, 64, 8, 120, 33, 1, 77]
BACKENDS = ["resident", "offload", "cpu", "hybrid", "auto"]
LAYER_TYPES = {  # per MoE layer: (gate/up, down) GGUF types written, and the bank format expected
    "qwen3_moe": [(("q4_K", "q6_K"), ExpertFormat.Q4_K_Q6_K), (("q4_K", "q4_K"), ExpertFormat.Q4_K)],
    "qwen2_moe": [(("q5_K", "q6_K"), ExpertFormat.Q5_K_Q6_K), (("q8_0", "q8_0"), ExpertFormat.Q8_0)],
    "gpt_oss": [(("mxfp4_gguf", "mxfp4_gguf"), ExpertFormat.MXFP4_GGUF)] * 3,
    "olmoe": [(("q8_0", "q8_0"), ExpertFormat.Q8_0)] * 2,
    "mixtral": [(("q6_K", "q6_K"), ExpertFormat.Q6_K), (("q5_K", "q6_K"), ExpertFormat.Q5_K_Q6_K)],
}
DEQUANTIZED_REFERENCE = ("gpt_oss", "olmoe", "mixtral")  # archs transformers' GGUF loader does not read


def _vocab() -> int:
    """The demo tokenizer's size (its tokens are the file's vocabulary: llama.cpp needs one row per token)."""
    import tempfile

    from tokenizers import Tokenizer

    from services.engine.models.demo import write_tokenizer_files

    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(d)
        return Tokenizer.from_file(f"{d}/tokenizer.json").get_vocab_size(with_added_tokens=True)


def _configs(vocab: int) -> dict:
    from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    # K types need D and I multiples of 256 (one super-block); MXFP4 of 32
    common = dict(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, tie_word_embeddings=False, num_experts_per_tok=2)
    return {
        "qwen3_moe": Qwen3MoeConfig(**common, hidden_size=256, head_dim=64, num_hidden_layers=2, num_experts=8,
                                    moe_intermediate_size=256, intermediate_size=512, norm_topk_prob=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "qwen2_moe": Qwen2MoeConfig(**common, hidden_size=256, num_hidden_layers=2, num_experts=8,
                                    moe_intermediate_size=256, intermediate_size=512,
                                    shared_expert_intermediate_size=256, norm_topk_prob=False),
        "gpt_oss": GptOssConfig(**{**common, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}, hidden_size=64,
                                head_dim=16, num_hidden_layers=3, num_local_experts=8, intermediate_size=64,
                                sliding_window=4,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 4096}),
        # clip_qkv 1: the clamp bites at these weight scales (llama.cpp: olmoe.attention.clamp_kqv)
        "olmoe": OlmoeConfig(**common, hidden_size=64, num_hidden_layers=2, num_experts=8, intermediate_size=64,
                             norm_topk_prob=False, clip_qkv=1.0, eos_token_id=2, pad_token_id=0),
        # GGUF architecture 'llama' with experts; attn_q / attn_k permuted in the file as llama.cpp does
        "mixtral": MixtralConfig(**common, hidden_size=256, num_hidden_layers=2, num_local_experts=8,
                                 intermediate_size=256, sliding_window=None),
    }


class GGUFCase:
    def __init__(self, arch: str, path: Path, hf, ref):
        self.arch, self.path, self.hf, self.ref = arch, path, hf, ref  # hf: the written model; ref: the reference


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, GGUFCase]:
    from transformers import AutoModelForCausalLM, GptOssForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    from transformers import MixtralForCausalLM, OlmoeForCausalLM

    classes = {"qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM, "gpt_oss": GptOssForCausalLM,
               "olmoe": OlmoeForCausalLM, "mixtral": MixtralForCausalLM}
    out = {}
    for seed, (arch, cfg) in enumerate(_configs(_vocab()).items()):
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        hf = classes[arch](cfg).eval()
        _randomize_(hf, seed)
        d = tmp_path_factory.mktemp(f"gguf-{arch}")
        path = write_gguf(hf, d / f"tiny-{arch}.gguf", [t for t, _ in LAYER_TYPES[arch]], seed=seed,
                          dense_type="q8_0" if arch == "qwen3_moe" else "f32")
        if arch in DEQUANTIZED_REFERENCE:
            ref = dequantized_reference(hf, path)
        else:
            ref = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, config=cfg, dtype=torch.float32).eval()
            ref.config._attn_implementation = "eager"
        out[arch] = GGUFCase(arch, path, hf, ref)
    return out


@pytest.fixture(scope="module")
def loaded(cases):
    return {arch: load_model(EngineConfig(model=str(c.path)), attach_backend=False) for arch, c in cases.items()}


@pytest.fixture(scope="module")
def reference_tokens(cases):
    return {arch: hf_greedy(c.ref, PROMPT, 24) for arch, c in cases.items()}


@pytest.mark.parametrize("arch", list(LAYER_TYPES))
def test_spec_from_metadata_matches_config(arch, cases, loaded):
    cfg, spec = cases[arch].hf.config, loaded[arch].spec
    assert spec.model_type == arch
    E = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    assert (spec.num_layers, spec.num_experts, spec.top_k) == (cfg.num_hidden_layers, E, cfg.num_experts_per_tok)
    assert (spec.hidden_size, spec.vocab_size, spec.num_heads, spec.num_kv_heads) == (
        cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert spec.head_dim == getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert spec.moe_intermediate_size == getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
    assert spec.renormalize == (arch not in ("qwen2_moe", "olmoe"))  # as llama.cpp's graphs (and the HF configs)
    assert spec.qkv_bias == (arch in ("qwen2_moe", "gpt_oss"))
    if arch == "olmoe":
        assert spec.clip_qkv == 1.0
    if arch == "qwen2_moe":
        assert spec.shared_expert_intermediate_size == cfg.shared_expert_intermediate_size
    if arch == "gpt_oss":
        assert spec.layer_windows == (4, None, 4) and spec.expert_bias and spec.rope_scaling["factor"] == 32.0


@pytest.mark.parametrize("arch", list(LAYER_TYPES))
def test_experts_stay_in_their_gguf_types(arch, cases, loaded):
    """Each layer's banks hold the file's blocks byte for byte, in the layer's format (a narrower layer's
    rows at the start of the widest row)."""
    import gguf

    reader = gguf.GGUFReader(str(cases[arch].path))
    data = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    banks = loaded[arch].banks
    for ordinal, (types, fmt) in enumerate(LAYER_TYPES[arch]):
        layer, t = loaded[arch].spec.moe_layer_ids[ordinal], banks.layers[ordinal].tensors
        assert banks.layers[ordinal].format is fmt
        I = t["gate_up"].shape[1] // 2
        gate, up, down = (data[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        assert torch.equal(t["gate_up"][:, :I, :gate.shape[-1]], gate)
        assert torch.equal(t["gate_up"][:, I:, :up.shape[-1]], up)
        assert torch.equal(t["down"][:, :, :down.shape[-1]], down)


@pytest.mark.parametrize("arch", list(LAYER_TYPES))
def test_last_logits_match_reference(arch, cases, loaded):
    lm = loaded[arch]
    lm.model.set_backend(build_backend(lm, EngineConfig(model=str(cases[arch].path))))
    kv = KVCache(lm.spec, 1, 64, "cpu", torch.float32)
    ours = lm.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), ForwardBatch.single(0, 0, len(PROMPT)), kv)[0]
    assert (ours - hf_last_logits(cases[arch].ref, PROMPT)).abs().max().item() <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(LAYER_TYPES))
def test_every_backend_greedy_equals_transformers(arch, backend, cases, loaded, reference_tokens):
    lm = loaded[arch]
    slots = {} if backend == "resident" else {"moe_cache_size": lm.spec.top_k}  # the smallest cache: misses every step
    backend_obj = build_backend(lm, EngineConfig(model=str(cases[arch].path), moe_backend=backend, **slots))
    lm.model.set_backend(backend_obj)
    try:
        ours = greedy_generate(lm, PROMPT, 24)
    finally:
        getattr(backend_obj, "close", lambda: None)()
    assert ours == reference_tokens[arch]
    assert len(set(ours)) > 1


# every expert type: Q4_K_M's pair; q5_K + q6_K and q8_0; gpt-oss's mxfp4_gguf rows of 64 (a partial input block)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_bfloat16_cpu_experts_take_int8_inputs(arch, cases):
    """A bf16 model's GGUF experts on the CPU executor (the cpu backend's misses) run the int8-input kernel
    (gguf_quant.q8_inputs; any CPU with AVX2): through the engine's layers, a decode step's logits
    stay as close to the fp32 reference as bf16's own rounding puts the resident path."""
    path = str(cases[arch].path)
    lm = load_model(EngineConfig(model=path, dtype="bfloat16"), attach_backend=False)
    ref = hf_last_logits(cases[arch].ref, PROMPT)
    errors = {}
    for backend in ("resident", "cpu"):
        slots = {} if backend == "resident" else {"moe_cache_size": lm.spec.top_k}  # the cpu backend's misses
        backend_obj = build_backend(lm, EngineConfig(model=path, dtype="bfloat16", moe_backend=backend, **slots))
        lm.model.set_backend(backend_obj)
        try:
            if backend == "cpu":
                ex = backend_obj.executor
                rounding = {ex.input_rounding(layer.format, torch.bfloat16) for layer in lm.banks.layers}
                assert rounding == ({None} if ex.isa == "scalar" else {q8_inputs})
            kv = KVCache(lm.spec, 1, 64, "cpu", torch.bfloat16)
            n = len(PROMPT) - 1  # the prompt but its last token, then that token as a decode step (the split path)
            lm.model(torch.tensor(PROMPT[:n]), torch.arange(n), ForwardBatch.single(0, 0, n), kv)
            logits = lm.model(torch.tensor(PROMPT[n:]), torch.tensor([n]), ForwardBatch.single(0, n, 1), kv)[0]
            errors[backend] = (logits.float() - ref).abs().max().item()
            if backend == "cpu":
                assert backend_obj.totals["cpu_routes"] > 0
        finally:
            getattr(backend_obj, "close", lambda: None)()
    # bf16 alone moves these logits (up to ~5) by ~0.09; int8 inputs may add about a third of that, a wrong
    # lane, scale or offset would move them by the experts' whole contribution
    assert errors["cpu"] <= 2 * errors["resident"], errors


def test_expert_dtype_dtype_dequantizes_gguf_experts(cases, reference_tokens):
    lm = load_model(EngineConfig(model=str(cases["qwen3_moe"].path), moe_expert_dtype="dtype"))
    assert {layer.format for layer in lm.banks.layers} == {ExpertFormat.UNQUANTIZED}
    assert greedy_generate(lm, PROMPT, 24) == reference_tokens["qwen3_moe"]


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2"])
def test_tokenizer_matches_transformers_gguf_tokenizer(pre, cases, tmp_path):
    """The tokenizer built from tokenizer.ggml.* encodes like transformers' GGUF tokenizer and like the
    tokenizer.json the file was written from; the chat template and the end ids come along."""
    import json

    from transformers import AutoTokenizer

    from services.common.tokenizer import Tokenizer
    from services.engine.models.demo import write_tokenizer_files
    from services.engine.models.gguf_reader import GGUFFile
    from services.engine.models.gguf_tokenizer import write_tokenizer_files as write_gguf_tokenizer

    path = write_gguf(cases["qwen3_moe"].hf, tmp_path / "tok.gguf", ("q8_0", "q8_0"), pre=pre)
    write_gguf_tokenizer(GGUFFile(path), tmp_path / "ours")
    write_tokenizer_files(tmp_path / "original")
    ours, original = Tokenizer.from_dir(tmp_path / "ours"), Tokenizer.from_dir(tmp_path / "original")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "don't stop 12345 numbers",
             "<|im_start|>user\nhi<|im_end|>\n", "émoji 🙂 and ünïcode", ""]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
        if pre == "gpt-2":  # the demo tokenizer's own pre-tokenizer: the very ids of its tokenizer.json
            assert ids == original.encode(text)
    config = json.loads((tmp_path / "original" / "tokenizer_config.json").read_text())
    assert ours.tokenizer_config["chat_template"] == config["chat_template"]
    assert ours.eos_token_ids == [ours.token_to_id(config["eos_token"])]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == original.apply_chat_template(
        [{"role": "user", "content": "hi"}])


def test_split_file_loads_like_the_single_file(cases, loaded, tmp_path):
    """A model split in two shards (llama.cpp's -0000K-of-0000N naming, metadata in the first) loads from its
    first shard with the same tokens as the single file."""
    import gguf

    src = gguf.GGUFReader(str(cases["qwen3_moe"].path))
    half = len(src.tensors) // 2
    for k, tensors in enumerate((src.tensors[:half], src.tensors[half:]), 1):
        w = gguf.GGUFWriter(str(tmp_path / f"tiny-{k:05d}-of-00002.gguf"), "qwen3moe" if k == 1 else None)
        if k == 1:
            for name, field in src.fields.items():
                if name.startswith("GGUF.") or name == "general.architecture":
                    continue
                value, vtype = field.contents(), field.types[0]
                sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(name, value, vtype, sub_type=sub)
        w.add_uint16("split.no", k - 1)
        w.add_uint16("split.count", 2)
        for t in tensors:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    lm = load_model(EngineConfig(model=str(tmp_path / "tiny-00001-of-00002.gguf")))
    assert lm.model_id == "tiny"
    want = loaded["qwen3_moe"]
    want.model.set_backend(build_backend(want, EngineConfig(model=str(cases["qwen3_moe"].path))))
    assert greedy_generate(lm, PROMPT, 12) == greedy_generate(want, PROMPT, 12)
    (tmp_path / "tiny-00002-of-00002.gguf").unlink()
    with pytest.raises(LoaderError, match=r"split GGUF model of 2 files is missing tiny-00002-of-00002\.gguf"):
        load_model(EngineConfig(model=str(tmp_path / "tiny-00001-of-00002.gguf")))


def _rewrite(src: Path, dst: Path, arch: str | None = None, retype: dict | None = None) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` with another architecture name and/or some tensors re-quantized
    to other types ({name: GGMLQuantizationType}, from their dequantized values)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    old = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch or old)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name.replace(old + ".", (arch or old) + ".", 1), field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        if retype and t.name in retype:
            w.add_tensor(t.name, gguf.quantize(gguf.dequantize(t.data, t.tensor_type), retype[t.name]),
                         raw_dtype=retype[t.name])
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _bad_files(src: Path, d: Path) -> dict[str, tuple[Path, str]]:
    import gguf

    Q4_0, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    truncated = d / "truncated.gguf"
    truncated.write_bytes(src.read_bytes()[:-4096])
    not_gguf = d / "notgguf.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(100))
    return {
        "arch": (_rewrite(src, d / "deepseek2.gguf", arch="deepseek2"),
                 r"GGUF architecture 'deepseek2' is not supported \(supported: architectures qwen3moe, qwen2moe, gpt-oss"),
        "type": (_rewrite(src, d / "q4_0.gguf", retype={f"blk.0.ffn_{p}_exps.weight": Q4_0 for p in ("gate", "up", "down")}),
                 r"expert tensor 'blk\.0\.ffn_gate_exps\.weight' has type Q4_0, which the engine does not hold "
                 r"\(supported: .*Q4_K, Q5_K, Q6_K, Q8_0, MXFP4"),
        "gate_up": (_rewrite(src, d / "mixed.gguf", retype={"blk.0.ffn_up_exps.weight": Q8_0}),
                    r"'blk\.0\.ffn_gate_exps\.weight' is Q4_K but 'blk\.0\.ffn_up_exps\.weight' is Q8_0"),
        "truncated": (truncated, r"truncated\.gguf: .*truncated"),
        "not_gguf": (not_gguf, r"notgguf\.gguf: not a readable GGUF file"),
    }


@pytest.mark.parametrize("case", ["arch", "type", "gate_up", "truncated", "not_gguf"])
def test_bad_files_get_one_clear_line(case, cases, tmp_path):
    """Preflight and the loader both refuse with one line naming the file and what is supported."""
    from services.engine.preflight import check_model

    path, pattern = _bad_files(cases["qwen3_moe"].path, tmp_path)[case]
    for refuse in (check_model, load_model):
        with pytest.raises(LoaderError, match=pattern) as err:
            refuse(EngineConfig(model=str(path)))
        assert "\n" not in str(err.value)


def test_serve_refuses_a_bad_file_in_one_line(cases, tmp_path):
    path, _ = _bad_files(cases["qwen3_moe"].path, tmp_path)["arch"]
    r = subprocess.run([sys.executable, "-m", "services.cli", "engine", "--model", str(path)], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "GGUF architecture 'deepseek2' is not supported" in lines[0], r.stderr


def test_preflight_counts_experts_in_their_gguf_type(cases, monkeypatch):
    """The host memory preflight counts a GGUF model's experts in the widest layer format (what every layer's
    banks take), not in --dtype."""
    from services.engine.moe.banks import expert_nbytes
    from services.engine.moe.sizing import fmt_bytes
    from services.engine import preflight
    from services.engine.preflight import check_model

    c = cases["qwen3_moe"]
    spec = check_model(EngineConfig(model=str(c.path)))
    D, I = spec.hidden_size, spec.moe_intermediate_size
    held = spec.num_moe_layers * spec.num_experts * expert_nbytes(ExpertFormat.Q4_K_Q6_K, D, I, torch.float32)
    assert held < spec.num_moe_layers * spec.num_experts * 3 * D * I  # well under fp32's 4 bytes per value
    monkeypatch.setattr(preflight, "_mem_available", lambda: 1)
    with pytest.raises(ValueError, match=rf"\(experts {fmt_bytes(held)} \+"):
        check_model(EngineConfig(model=str(c.path)))


@pytest.mark.parametrize("experts", ["q8_0", "mxfp4_gguf"])
def test_synthetic_experts_in_gguf_types(experts):
    """``synthetic:NAME?experts=TYPE``: banks in the GGUF type at the preset's geometry, values of the float
    init's spread (dequantized by the gguf package), and the model decodes."""
    from services.engine.models.synthetic import param_std
    from services.engine.moe.dequant import dense_experts

    lm = load_model(EngineConfig(model=f"synthetic:tiny?experts={experts}"))
    assert {layer.format for layer in lm.banks.layers} == {ExpertFormat(experts)}
    t = lm.banks.layers[0].tensors
    gate_up, down = dense_experts(ExpertFormat(experts), t["gate_up"], t["down"], None, None, torch.float32)
    assert gate_up.shape[1:] == (2 * lm.spec.moe_intermediate_size, lm.spec.hidden_size)
    for name, w in (("gate_up", gate_up), ("down", down)):
        want = param_std(f"experts.{name}", lm.spec)
        assert 0.6 * want < float(w.std()) < 1.5 * want  # mxfp4: one power-of-two scale per tensor
    assert len(set(greedy_generate(lm, PROMPT, 8))) > 1


def test_q4_K_M_mix_follows_llama_cpp():
    """llama.cpp's use_more_bits: down in q6_K in the first and last eighth of the layers and every third
    between (48 layers: 0-5, 42-47, and 8, 11, ..., 41)."""
    from services.engine.models.gguf_random import layer_types

    types = layer_types("q4_K_M", 48)
    more = [i for i, (gu, down) in enumerate(types) if down == "q6_K"]
    assert {gu for gu, _ in types} == {"q4_K"}
    assert more == [0, 1, 2, 3, 4, 5, *range(8, 42, 3), 42, 43, 44, 45, 46, 47]
    with pytest.raises(ValueError, match="unknown GGUF expert types 'q3_K'"):
        layer_types("q3_K", 4)


@pytest.mark.parametrize("model, message", [
    ("synthetic:tiny?experts=q4_K", r"q4_K expert banks need the hidden size \(64\) to be a multiple of 256"),
    ("synthetic:tiny?experts=q3_K", r"experts must be one of q4_K, q5_K, q6_K, q8_0, mxfp4_gguf, q4_K_M, q5_K_M"),
])
def test_synthetic_refuses_a_type_its_geometry_cannot_hold(model, message):
    with pytest.raises(LoaderError, match=message):
        load_model(EngineConfig(model=model))


@pytest.mark.parametrize("experts, split", [("q8_0", 0), ("mxfp4_gguf", 40_000)])
def test_benchmark_writer_round_trips_the_synthetic_model(experts, split, tmp_path):
    """benchmarks/write_gguf.py writes the synthetic model in llama.cpp's layout (one file, or shards): the
    engine loads the same expert bytes and, non-expert matrices written f32, the same logits."""
    from benchmarks.write_gguf import write

    files = write("tiny", experts, tmp_path / "tiny.gguf", seed=3, split_max_size=split, dense="f32")
    assert (len(files) > 1) == bool(split)
    ours = load_model(EngineConfig(model=str(files[0])))
    want = load_model(EngineConfig(model=f"synthetic:tiny?experts={experts}", seed=3))
    for a, b in zip(ours.banks.layers, want.banks.layers):
        assert a.format is b.format and torch.equal(a.tensors["gate_up"], b.tensors["gate_up"])
        assert torch.equal(a.tensors["down"], b.tensors["down"])
    logits = []
    for lm in (ours, want):
        kv = KVCache(lm.spec, 1, 64, "cpu", torch.float32)
        logits.append(lm.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), ForwardBatch.single(0, 0, len(PROMPT)), kv)[0])
    assert (logits[0] - logits[1]).abs().max().item() <= tolerance(torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["resident", "offload", "hybrid", "auto"])
@pytest.mark.parametrize("arch", list(LAYER_TYPES))
def test_cuda_decode_and_its_graph_equal_transformers(arch, backend, cases, reference_tokens):
    """On CUDA (fp32) the experts stay in their GGUF blocks on the device (the Triton GEMV / grouped GEMM on the
    layers whose rows fit their types, torch dequantizing the padded ones): greedy tokens equal the
    reference's, eager and replayed from the runner's captured decode graph, with no fallback to torch."""
    from services.engine.models import fused
    from services.engine.moe.resident import moe_decode
    from tests.helpers import graph_greedy

    slots = {} if backend == "resident" else {"moe_cache_size": 2}  # top-2: misses every step
    lm = load_model(EngineConfig(model=str(cases[arch].path), device="cuda", moe_backend=backend, **slots))
    try:
        assert {layer.format for layer in lm.banks.layers} == {fmt for _, fmt in LAYER_TYPES[arch]}
        eager = greedy_generate(lm, PROMPT, 24)
        assert eager == reference_tokens[arch], f"kernel {moe_decode.kind}, broken {fused._broken}"
        assert graph_greedy(lm, backend, PROMPT, 24) == reference_tokens[arch]
    finally:
        getattr(lm.backend, "close", lambda: None)()
    assert moe_decode.kind == "triton" and not fused._broken, f"fell back to torch: {fused._broken}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_q4_K_M_synthetic_serves_every_backend():
    """The real geometry: synthetic Qwen3-30B-A3B (2 layers) with llama.cpp's q4_K_M mix (one padded layer), bf16
    on CUDA: offload gives resident's tokens (the same kernels on the slots), hybrid (the CPU executor on part
    of the misses) logits within bf16 tolerance of resident's."""
    model = "synthetic:qwen3-30b-a3b?layers=2&experts=q4_K_M"
    out = {}
    for backend in ("resident", "offload", "hybrid"):
        slots = {} if backend == "resident" else {"moe_cache_rate": 0.1}
        lm = load_model(EngineConfig(model=model, device="cuda", dtype="bfloat16", moe_backend=backend, **slots))
        try:
            kv = KVCache(lm.spec, 1, 64, "cuda", torch.bfloat16)
            logits = lm.model(torch.tensor(PROMPT, device="cuda"), torch.arange(len(PROMPT), device="cuda"),
                              ForwardBatch.single(0, 0, len(PROMPT)), kv)[0].float().cpu()
            out[backend] = (logits, greedy_generate(lm, PROMPT, 8))
        finally:
            getattr(lm.backend, "close", lambda: None)()
    ref = out["resident"][0]
    assert out["offload"][1] == out["resident"][1]
    assert (out["hybrid"][0] - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("arch", ["gpt_oss", "olmoe", pytest.param("qwen3_moe", marks=pytest.mark.slow)])  # ~5 min
def test_triton_code_paths_equal_transformers(arch, cases, reference_tokens, monkeypatch):
    """What the CUDA model runs, on CPU tensors (TRITON_INTERPRET): the MoE GEMV / grouped GEMM on the GGUF
    banks (mxfp4_gguf with gpt-oss's biases and clamped SwiGLU; q8_0; qwen3's q4_K+q6_K layer and its q4_K
    layer whose down rows are padded to q6_K's width, the kernels named each layer's types) and every fused
    kernel: greedy tokens equal the reference's, no fallback. The CPU twin of
    test_cuda_decode_and_its_graph_equal_transformers."""
    from kernels.moe_gemm import moe_gemm
    from kernels.moe_gemv import moe_gemv
    from services.engine.models import fused
    from services.engine.moe import resident

    kernel = resident.DecodeKernel()
    calls = {"gemv": 0, "gemm": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    kernel._gemv, kernel._gemm = counted("gemv", moe_gemv), counted("gemm", moe_gemm)
    monkeypatch.setattr(resident, "moe_compute", lambda *args, **kwargs: kernel(*args, **kwargs))  # as on CUDA
    monkeypatch.setattr(fused, "FORCE", True)
    monkeypatch.setattr(fused, "_broken", set())
    lm = load_model(EngineConfig(model=str(cases[arch].path)))
    ours = greedy_generate(lm, PROMPT, 8)
    assert kernel.kind == "triton" and not fused._broken, f"fell back to torch: {fused._broken}"
    L = lm.spec.num_moe_layers
    assert calls == {"gemm": L, "gemv": 7 * L}  # the prefill's 22 routes on the GEMM, each decode step on the GEMV
    assert ours == reference_tokens[arch][:8]


def test_sentencepiece_tokenizer_matches_transformers_gguf_tokenizer(tmp_path):
    """tokenizer.ggml.model 'llama' (Mixtral's SentencePiece BPE: byte fallback, merges recovered from the
    scores, Metaspace): the same ids as transformers' GGUF tokenizer, and decoding gives the text back."""
    import gguf
    import numpy as np
    from tokenizers import SentencePieceBPETokenizer
    from transformers import AutoTokenizer

    from services.common.tokenizer import Tokenizer
    from services.engine.models.demo import _CORPUS
    from services.engine.models.gguf_reader import GGUFFile
    from services.engine.models.gguf_tokenizer import write_tokenizer_files as write_gguf_tokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator([_CORPUS] * 4, vocab_size=400, min_frequency=2, show_progress=False)
    trained = sp.get_vocab()
    merges = [m if isinstance(m, str) else " ".join(m) for m in __import__("json").loads(sp.to_str())["model"]["merges"]]
    rank = {"".join(m.split(" ")): i for i, m in enumerate(merges)}
    # llama's layout: <unk> <s> </s>, the 256 byte tokens, then the pieces (scores: earlier merges higher)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [t for t, _ in sorted(trained.items(), key=lambda kv: kv[1]) if t not in tokens]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)]
    scores = [0.0] * 259 + [-float(rank.get(t, 0)) if t in rank else 0.0 for t in tokens[259:]]
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_gguf_tokenizer(GGUFFile(tmp_path / "spm.gguf"), tmp_path / "ours")
    ours = Tokenizer.from_dir(tmp_path / "ours")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["Hello world", "the experts  live in\nhost memory", "émoji 🙂 ü", " leading space", "</s>x", ""]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.eos_token_ids == [2]
    assert len(ours.encode("the experts live in host memory")) < 12  # merges applied, not bytes / characters


def test_engine_serves_a_gguf_chat_with_a_grammar(cases):
    """The engine on a GGUF file, as the gateway sees it: its info carries the file's tokenizer and chat
    template (what the gateway builds its tokenizer from), a chat prompt rendered with it generates, and a
    JSON-schema grammar (llguidance over the tokenizer.json built from the metadata) constrains the output."""
    import asyncio
    import json

    from services.common.tokenizer import Tokenizer
    from services.engine.engine import Engine
    from services.engine.runtime.sampler import SamplingParams

    engine = Engine(EngineConfig(model=str(cases["qwen3_moe"].path), max_seq_len=256, max_running_requests=2))
    engine.start()
    try:
        engine.wait_ready(120)
        info = engine._info
        assert info["model_id"] == "tiny-qwen3_moe"
        tok = Tokenizer.from_info(info)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
        assert prompt[:1] == [tok.token_to_id("<|im_start|>")]
        schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
                  "additionalProperties": False}

        async def run():
            ids, finish = [], None
            params = SamplingParams(max_tokens=200, temperature=1.0, seed=1, grammar={"json_schema": schema})
            async for out in engine.submit("gguf-1", prompt, params):
                ids += out["token_ids"]
                finish = out["finish_reason"]
            return ids, finish

        ids, finish = asyncio.run(run())
        assert finish == "stop"
        text = tok.decode([i for i in ids if i not in tok.eos_token_ids])
        assert json.loads(text)["n"] in (1, 2, 3)
    finally:
        engine.shutdown()


def test_bank_formats_name_the_kernels_types():
    """banks.GGUF_TYPES (what the compute paths name to the kernels) agrees with gguf_quant.format_types (what
    the CPU executor derives from a format's value), and every GGUF format's banks are whole rows of its types."""
    from services.engine.moe.banks import BANK_SCHEMAS, GGUF_TYPES
    from services.engine.moe.gguf_quant import format_types, row_bytes

    assert set(GGUF_TYPES) == {f for f in ExpertFormat if format_types(f.value) is not None}
    for fmt, (gu, down) in GGUF_TYPES.items():
        assert format_types(fmt.value) == (gu, down)
        shapes = {s.name: s.shape(512, 256) for s in BANK_SCHEMAS[fmt]}
        assert shapes == {"gate_up": (512, row_bytes(gu, 512)), "down": (512, row_bytes(down, 256))}


def test_per_expert_tensors_of_early_conversions_are_refused(cases, tmp_path):
    """A file without stacked ffn_*_exps tensors (early Mixtral conversions stored one per expert) is refused
    in one line saying so, not as a dense model."""
    import gguf

    src = gguf.GGUFReader(str(cases["qwen3_moe"].path))
    path = tmp_path / "per-expert.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in src.tensors:
        if "_exps." in t.name:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoaderError, match=r"no stacked expert tensors .* one tensor per expert") as err:
        load_model(EngineConfig(model=str(path)))
    assert "\n" not in str(err.value)
