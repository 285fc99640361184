"""The serving benchmark end to end on the CPU: a real `tandem serve`, distinct prompts streamed through
the gateway at fixed concurrency and as Poisson arrivals; every level's row has its latencies and
throughput, no errors, and fp32 greedy texts equal to each prompt's solo text (matches_solo = 1).
The long-prompt mode: token-id prompts of exactly the asked length (no special tokens, no two alike at
the start), and a row per length with TTFT, prefill rate and the background streams' ITL."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from benchmarks.chat_prompts import chat_prompts
from benchmarks.long_prompts import ordinary_token_ids, token_prompt
from services.engine.models.demo import SPECIAL_TOKENS, write_tokenizer_files

ROOT = Path(__file__).resolve().parents[2]


def test_prompt_set_is_distinct_reproducible_and_prefix_stable():
    prompts = chat_prompts(64, seed=3)
    assert len(set(prompts)) == 64
    assert chat_prompts(64, seed=3) == prompts and chat_prompts(16, seed=3) == prompts[:16]
    assert chat_prompts(64, seed=4) != prompts
    words = [len(p.split()) for p in prompts]
    assert min(words) >= 30 / 1.3 - 1 and max(words) <= 100 / 1.3 + 15  # targets + at most one sentence


def test_concurrency_and_rate_levels_on_cpu(tmp_path):
    out, png = tmp_path / "rows.jsonl", tmp_path / "serving.png"
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--model", "demo", "--device", "cpu", "--dtype", "float32",
           "--backend", "offload", "--concurrency", "1,3", "--request-rate", "20", "--num-prompts", "6", "--level-warmup", "1",
           "--output-tokens", "5", "--startup-timeout", "300", "--log-dir", str(tmp_path / "logs"),
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r[r["mode"]]) for r in rows] == [("concurrency", 1), ("concurrency", 3), ("rate", 20.0)]
    assert [r["level_warmup_requests"] for r in rows] == [1, 3, 0]  # 1 x C before each concurrency level
    for r in rows:
        assert r["ok"] and r["errors"] == 0 and r["requests"] == 6
        assert r["total_tok_s"] > 0 and r["req_s"] > 0 and r["prompt_tokens_mean"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
        assert 0.0 <= r["miss_rate"] <= 1.0  # the engine's counters over the level
        assert r["matches_solo"] == 1.0  # fp32 on the CPU: neighbours never change a greedy text
    assert png.stat().st_size > 10_000


def test_token_prompts_are_exact_ordinary_and_distinct(tmp_path):
    write_tokenizer_files(tmp_path)
    text = (tmp_path / "tokenizer.json").read_text()
    tokenizer = Tokenizer.from_str(text)
    ordinary = ordinary_token_ids({"tokenizer_json": text})
    special = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    assert None not in special and not special & set(ordinary)
    assert len(ordinary) == tokenizer.get_vocab_size(with_added_tokens=True) - len(special)
    prompts = [token_prompt(ordinary, n, i, seed=0) for i, n in enumerate([1, 2, 511, 3000, 3000])]
    assert [len(p) for p in prompts] == [1, 2, 511, 3000, 3000]
    assert len({p[0] for p in prompts}) == 5 and set().union(*prompts) <= set(ordinary)
    assert token_prompt(ordinary, 3000, 4, seed=0) == prompts[4]  # reproducible
    assert token_prompt(ordinary, 3000, 4, seed=1) != prompts[4]


def test_long_prompt_mode_on_cpu(tmp_path):
    out, png = tmp_path / "long.jsonl", tmp_path / "long.png"
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--model", "demo", "--device", "cpu", "--dtype", "float32",
           "--backend", "resident", "--prompt-tokens", "300,1200", "--output-tokens", "4", "--repeats", "1",
           "--background-streams", "2", "--startup-timeout", "300", "--log-dir", str(tmp_path / "logs"),
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["prompt_tokens"]) for r in rows] == [("long_prompt", 300), ("long_prompt", 1200)]
    for r in rows:
        assert r["ok"] and r["errors"] == 0 and r["repeats"] == 1 and r["background_errors"] == 0
        assert r["usage_prompt_tokens"] == r["prompt_tokens"]  # exactly the ids sent, nothing added
        assert r["cached_tokens"] == 0  # distinct first tokens: no prefix-cache help
        assert r["ttft_s"] > 0 and r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])
        assert r["decode_tok_s"] > 0 and r["preemptions"] == 0
        assert r["background_streams"] == 2 and r["bg_itl_gaps"] > 0
        assert 0 < r["bg_itl_ms_p50"] <= r["bg_itl_ms_p99"] and r["bg_itl_ms_p99_before"] > 0
        assert {"backend", "cache_rate", "model", "date", "command"} <= r.keys()
    lines = proc.stdout.splitlines()
    assert "prefill/s" in lines[0] and len(lines) == 3, proc.stdout  # the header and a line per row
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
