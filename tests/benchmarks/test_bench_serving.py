"""The serving benchmark end to end on the CPU: a real `tandem serve`, distinct prompts streamed through
the gateway at fixed concurrency and as Poisson arrivals; every level's row has its latencies and
throughput, no errors, and fp32 greedy texts equal to each prompt's solo text (matches_solo = 1)."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.chat_prompts import chat_prompts

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
