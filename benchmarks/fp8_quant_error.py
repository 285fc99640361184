"""How much ``--moe-expert-dtype fp8`` changes a model's outputs: the same model with its experts as
loaded (bf16 by default) and then quantized in place to fp8_block, on the same teacher-forced tokens.

Per prompt of benchmarks/prompts/math.jsonl: prefill, then ``--tokens`` decode steps fed the reference's
own greedy tokens (teacher forcing: both runs see the same inputs, so errors do not compound through
different continuations). Reported over all positions: mean and max KL(p_ref || p_fp8) in nats, top-1
agreement, and the largest logit difference relative to the reference logits' standard deviation.

    .venv/bin/python -m benchmarks.fp8_quant_error --model 'synthetic:qwen3-30b-a3b?layers=2'
    .venv/bin/python -m benchmarks.fp8_quant_error --model /path/to/Qwen3-30B-A3B --prompts 8 --device cuda

Prints one JSON row (the numbers in docs/fp8.md). Experts are quantized layer by layer in place, so
peak memory is the model once plus one layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from services.engine.config import EngineConfig
from services.engine.models.registry import build_backend, load_model
from services.engine.moe.fp8 import quantize_layers
from services.engine.runtime.kv_cache import ForwardBatch, KVCache

PROMPTS = Path(__file__).parent / "prompts" / "math.jsonl"


def prompt_ids(model_dir: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lines = PROMPTS.read_text().splitlines()[:n]
    return [tok.encode(json.loads(line)["problem"]).ids for line in lines]


@torch.no_grad()
def logits_along(lm, prompt: list[int], forced: list[int] | None, steps: int) -> tuple[torch.Tensor, list[int]]:
    """[steps, V] fp32 logits: after the prompt, then after each forced token (greedy ones when None)."""
    kv = KVCache(lm.spec, 1, len(prompt) + steps + 1, lm.device, lm.dtype)
    dev = lm.device
    out = [lm.model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev),
                    ForwardBatch.single(0, 0, len(prompt)), kv)[0]]
    tokens = []
    for i in range(steps - 1):
        tokens.append(int(out[-1].argmax()) if forced is None else forced[i])
        pos = len(prompt) + i
        out.append(lm.model(torch.tensor([tokens[-1]], device=dev), torch.tensor([pos], device=dev),
                            ForwardBatch.single(0, pos, 1), kv)[0])
    return torch.stack(out).float().cpu(), tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_quant_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b?layers=2", help="checkpoint dir or synthetic:NAME (default: %(default)s)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="compute device (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="reference dtype (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="prompts of math.jsonl (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=16, help="positions compared per prompt (default: %(default)s)")
    args = p.parse_args(argv)
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_seq_len=512)
    lm = load_model(cfg)
    prompts = prompt_ids(lm.model_dir, args.prompts)
    refs = [logits_along(lm, ids, None, args.tokens) for ids in prompts]
    t0 = time.perf_counter()
    quantize_layers(lm.banks.layers, work_device=lm.device if lm.device.type == "cuda" else None)
    quant_s = time.perf_counter() - t0
    lm.model.set_backend(build_backend(lm, cfg))
    kl, agree, rel = [], 0, 0.0
    for ids, (ref, forced) in zip(prompts, refs):
        got, _ = logits_along(lm, ids, forced, args.tokens)
        lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
        kl.append((lp.exp() * (lp - lq)).sum(-1))  # [steps]
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        rel = max(rel, ((got - ref).abs().max(-1).values / ref.std(-1)).max().item())
    kl_all = torch.cat(kl)
    row = {"model": args.model, "device": args.device, "dtype": args.dtype, "positions": kl_all.numel(), "kl_mean_nats": kl_all.mean().item(),
           "kl_max_nats": kl_all.max().item(), "top1_agreement": agree / kl_all.numel(),
           "max_logit_diff_over_std": rel, "quantize_seconds": quant_s,
           "expert_bytes_fp8": lm.banks.expert_nbytes()}
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
