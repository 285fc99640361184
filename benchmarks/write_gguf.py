"""Write a synthetic model (services/engine/models/synthetic.py: random weights at a real model's geometry) as a
GGUF file in llama.cpp's layout, experts in GGUF types, so the very same file can be served by Tandem
(``--model FILE.gguf``) and by other engines (llama.cpp's llama-server / llama-bench) side by side.

    python -m benchmarks.write_gguf --model 'qwen3-30b-a3b?layers=24' --experts q4_K_M --out /data/q3-24l.gguf

``--experts``: q4_K, q5_K, q6_K, q8_0, mxfp4_gguf, or llama.cpp's q4_K_M / q5_K_M mixes (gate/up in the base
type, ffn_down in q6_K in the layers llama.cpp's use_more_bits picks: models/gguf_random.py). The experts are
the synthetic model's random blocks as they are; the other matrices are written F16, norms and biases F32
(what llama.cpp's converter keeps in full precision). The tokenizer is the synthetic model's (the demo BPE,
padded to the preset's vocabulary) with pre-tokenizer 'gpt-2' (llama.cpp's name for GPT-2's). ``--split-max-size 4G`` writes
``-0000K-of-0000N.gguf`` shards (llama.cpp's gguf-split naming). Tensors stream to the file one at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from services.engine.models import synthetic
from services.engine.models.errors import LoaderError
from services.engine.models.gguf_loader import ARCHS, expert_names, gguf_name
from services.engine.models.spec import ModelSpec
from services.engine.moe.banks import GGUF_TYPES, ExpertFormat
from services.engine.moe.gguf_quant import GGML_TYPE_ID, row_bytes as gguf_row_bytes



def _arch(spec: ModelSpec) -> str:
    for name, a in ARCHS.items():
        if a.model_type == spec.model_type:
            return name
    raise LoaderError(f"no GGUF architecture for model_type {spec.model_type!r} (supported: {', '.join(ARCHS)})")


def _metadata(w, spec: ModelSpec, tokenizer_dir: Path) -> None:
    import gguf

    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size or spec.moe_intermediate_size)
    w.add_expert_feed_forward_length(spec.moe_intermediate_size)
    if spec.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_expert_count(spec.num_experts)
    w.add_expert_used_count(spec.top_k)
    if spec.model_type == "gpt_oss":
        w.add_sliding_window(next(win for win in spec.layer_windows if win))
        if spec.rope_scaling:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(spec.rope_scaling["factor"])
            w.add_rope_scaling_orig_ctx_len(spec.rope_scaling["original_max_position_embeddings"])
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    gen = json.loads((tokenizer_dir / "generation_config.json").read_text(encoding="utf-8"))
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [f"[PAD{i}]" for i in range(max(spec.vocab_size, max(vocab.values()) + 1))]
    for t, i in vocab.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's split regex (the demo BPE's ByteLevel one)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else
                       gguf.TokenType.USER_DEFINED if t.startswith("[PAD") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    eos = gen.get("eos_token_id")
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if gen.get("bos_token_id") is not None:
        w.add_bos_token_id(gen["bos_token_id"])
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])


def write(model: str, experts: str, out: Path, seed: int = 0, split_max_size: int = 0,
          dense: str = "f16") -> list[Path]:
    """Build ``synthetic:MODEL?experts=EXPERTS`` and write it to ``out`` (matrices other than the experts in
    ``dense``: f16 or f32); returns the files written."""
    import gguf

    name = f"{synthetic.PREFIX}{model}{'&' if '?' in model else '?'}experts={experts}"
    tok_dir = synthetic.tokenizer_dir(name)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    spec, net, banks = synthetic.build_synthetic(name, vocab, torch.device("cpu"), torch.float32, seed)
    arch = _arch(spec)
    w = gguf.GGUFWriter(str(out), arch, split_max_size=split_max_size)
    w.add_name(f"tandem synthetic {model} ({experts} experts)")
    _metadata(w, spec, tok_dir)
    jobs = []  # (name, numpy array, raw type or None), in file order
    for pname, p in net.named_parameters():
        if pname == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        gname = gguf_name(pname)[-1 if spec.model_type == "gpt_oss" and "post_attention" in pname else 0]
        values = p.detach()
        if pname.endswith("shared_expert_gate.weight"):
            values = values.reshape(-1)  # llama.cpp stores it as a vector [D]
        is_matrix = values.dim() == 2 and not gname.endswith(("_norm.weight", "norm.weight"))
        matrix_dtype = {"f16": torch.float16, "f32": torch.float32}[dense]
        jobs.append((gname, values.to(matrix_dtype if is_matrix else torch.float32).numpy(), None))
    D, I = spec.hidden_size, spec.moe_intermediate_size
    for ordinal, layer in enumerate(spec.moe_layer_ids):
        lb = banks.layers[ordinal]
        gu_type, down_type = GGUF_TYPES[ExpertFormat(lb.format)]
        gu, dn = lb.tensors["gate_up"][..., :gguf_row_bytes(gu_type, D)], lb.tensors["down"][..., :gguf_row_bytes(down_type, I)]
        names = expert_names(layer)
        for p, data, qtype in (("gate", gu[:, :I], gu_type), ("up", gu[:, I:], gu_type), ("down", dn, down_type)):
            jobs.append((names[p], data.numpy(), gguf.GGMLQuantizationType(GGML_TYPE_ID[qtype])))
        if lb.bias is not None:  # gpt-oss
            b_gu, b_d = lb.bias
            for p, v in (("gate", b_gu[:, :I]), ("up", b_gu[:, I:]), ("down", b_d)):
                jobs.append((names[p].replace(".weight", ".bias"), v.float().contiguous().numpy(), None))
    for gname, data, raw in jobs:
        w.add_tensor_info(gname, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for gname, data, _ in tqdm(jobs, desc=f"writing {out.name}", unit="tensor"):
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    files = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf")) if split_max_size else [out]
    return files


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.write_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="synthetic preset with options, e.g. 'qwen3-30b-a3b?layers=24' "
                        f"(presets: {', '.join(synthetic.PRESETS)})")
    parser.add_argument("--experts", default="q4_K_M", help="expert types: q4_K, q5_K, q6_K, q8_0, mxfp4_gguf, q4_K_M "
                        "or q5_K_M (default q4_K_M)")
    parser.add_argument("--out", required=True, type=Path, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--dense", choices=("f16", "f32"), default="f16", help="type of the non-expert matrices "
                        "(default f16; norms and biases are f32)")
    parser.add_argument("--split-max-size", default="0", help="split into shards of at most this size (e.g. 4G); "
                        "0 = one file")
    args = parser.parse_args(argv)
    if args.out.suffix != ".gguf":
        parser.error(f"--out {args.out}: the file name must end in .gguf")
    try:
        files = write(args.model, args.experts, args.out, args.seed, _size(args.split_max_size), args.dense)
    except (LoaderError, ValueError) as e:
        print(f"write_gguf: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f"{f}\t{f.stat().st_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
