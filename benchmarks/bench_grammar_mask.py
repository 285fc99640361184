"""What constrained decoding costs the engine per token, on the CPU: the engine's own GrammarCompiler and
TokenMasks (services/engine/runtime/grammar.py, llguidance) over a synthetic byte-level vocabulary of
Qwen3's size, following a JSON document token by token.

Per batch size B (B requests, each with its own matcher): the time of one step's masks — filled in
parallel on the host, unpacked and applied to fp32 logits [B, V] — split into the fill alone and
fill + apply, next to the sampler's own time for the same logits (what a step costs without a grammar).
Also the one-off costs: the tokenizer's conversion (once per engine) and a schema's compilation (once
per request, at submit).

    python -m benchmarks.bench_grammar_mask [--vocab 151936] [--batch 1,8,32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time

import torch

from benchmarks.stats import percentile

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit", "hourly"],
          "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                         "unit": {"enum": ["celsius", "fahrenheit"]},
                         "hourly": {"type": "array", "items": {"type": "object", "required": ["t", "rain"],
                                                               "properties": {"t": {"type": "number"},
                                                                              "rain": {"type": "boolean"}}}}}}
DOCUMENT = {"city": "San Francisco de Campeche", "days": 12, "unit": "celsius",
            "hourly": [{"t": 21.5 + i, "rain": i % 3 == 0} for i in range(12)]}


def synthetic_tokenizer_json(vocab: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json with ``vocab`` tokens: the 256 bytes, then random words (with and
    without a leading space, some with JSON punctuation), and an EOS. No merges: the masks only read the
    tokens' bytes, and the document is tokenized by llguidance itself."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_of = {c: c for c in alphabet}
    words = dict.fromkeys(sorted(alphabet))
    pieces = string.ascii_lowercase + string.digits
    while len(words) < vocab - 1:
        word = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 9)))
        word = rng.choice(["", "Ġ", "\"", "\":", "Ġ\"", ",\""]) + word + rng.choice(["", "", "\"", "\","])
        words.setdefault("".join(byte_of.get(c, c) for c in word))
    tok = Tokenizer(BPE(vocab={w: i for i, w in enumerate(words)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str()


def main(argv: list[str] | None = None) -> int:
    from services.engine.runtime.grammar import GrammarCompiler, TokenMasks
    from services.engine.runtime.sampler import Sampler, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default: Qwen3's 151936)")
    p.add_argument("--batch", default="1,8,32", help="comma list of batch sizes (requests with a grammar)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    tokenizer_json = synthetic_tokenizer_json(args.vocab)
    eos = args.vocab - 1
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer_json, args.vocab, [eos])
    compiler.tokenizer  # the conversion, once per engine
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile({"json_schema": SCHEMA})
    compile_ms = (time.perf_counter() - t0) * 1e3
    doc = json.dumps(DOCUMENT, separators=(",", ":"))
    path = compiler.tokenizer.tokenize_str(doc) + [eos]
    print(f"vocab {args.vocab}: tokenizer conversion {tokenizer_s:.2f} s, schema compile {compile_ms:.1f} ms, "
          f"document {len(doc)} chars = {len(path)} tokens")

    rows = []
    masks, sampler = TokenMasks(compiler.mask_vocab), Sampler()
    for B in (int(b) for b in args.batch.split(",")):
        matchers = [compiler.compile({"json_schema": SCHEMA}) for _ in range(B)]
        logits = torch.randn(B, args.vocab)
        params, gens = [SamplingParams(temperature=0.0)] * B, [None] * B
        fill_us, apply_us, sample_us = [], [], []
        for tok in path:
            step_logits = logits.clone()
            t0 = time.perf_counter()
            masks.apply(step_logits, matchers)
            apply_us.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            masks.fill(matchers)
            fill_us.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            sampler.sample(logits, params, gens)
            sample_us.append((time.perf_counter() - t0) * 1e6)
            for m in matchers:
                assert m.consume_token(tok), m.get_error()
        row = {"vocab": args.vocab, "batch": B, "tokens": len(path),
               "fill_us_median": statistics.median(fill_us), "mask_step_us_median": statistics.median(apply_us),
               "mask_step_us_p90": percentile(apply_us, 90),
               "sampler_us_median": statistics.median(sample_us)}
        row["mask_us_per_request"] = row["mask_step_us_median"] / B
        rows.append(row)
        print(f"B={B:3d}: fill {row['fill_us_median']:8.0f} us, fill+apply {row['mask_step_us_median']:8.0f} us "
              f"(p90 {row['mask_step_us_p90']:.0f}) = {row['mask_us_per_request']:6.0f} us per request; "
              f"sampler alone {row['sampler_us_median']:6.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokenizer_s": tokenizer_s, "compile_ms": compile_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
