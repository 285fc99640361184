"""The benchmark suite end to end at its tiny scale (the demo model on the CPU, real servers), and its
table from rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.suite import SCALES, headline_rows, markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_suite_writes_every_output(tmp_path):
    out = tmp_path / "suite"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "bench", "suite", "--scale", "tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "suite.json").read_text())
    assert summary["status"] == {"ceilings": 0, "decode": 0, "serving": 0, "resident": "skipped: needs CUDA",
                                 "long": 0, "routing": 0, "gguf": 0}
    assert summary["ceilings"]["cpu_read_sum_fp32_GBs"] > 0 and summary["ceilings"]["gpu"] is None
    assert [(r["backend"], r["cache_rate"]) for r in summary["headline"]] == [("resident", None), ("hybrid", 0.5),
                                                                             ("cpu", 0.25)]
    assert all(r["tok_s"] > 0 and r["servers"] == 1 for r in summary["headline"])
    cpu = summary["headline"][2]  # the CPU-only ceilings bound the cpu backend (its DRAM read)
    assert cpu["bound_tok_s"] > 0 and cpu["bound_ratio"] == pytest.approx(cpu["tok_s"] / cpu["bound_tok_s"])
    rows = [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["ok"] for r in rows)
    assert len({r["output_sha1"] for r in rows}) >= 1
    serving = [json.loads(line) for line in (out / "serving.jsonl").read_text().splitlines()]
    assert [r["concurrency"] for r in serving] == [1, 2] and all(r["ok"] and not r["errors"] for r in serving)
    assert (out / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| resident | all |" in table and "| cpu | 25 % |" in table and "## Commands" in table
    assert "\n| 2 | " in table  # the concurrency table's second level
    long = [json.loads(line) for line in (out / "long.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in long] == [300, 1200] and all(r["ok"] and not r["errors"] for r in long)
    assert "## Long prompts" in table and "\n| hybrid | 1200 | " in table
    assert (out / "long.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    routed = [json.loads(line) for line in (out / "routing.jsonl").read_text().splitlines()]
    assert [r["model"] for r in routed] == ["synthetic:tiny?routing=sticky", "synthetic:tiny?routing=flat"]
    assert all(r["ok"] and r["backend"] == "hybrid" and r["miss_rate"] is not None for r in routed)
    assert "## By routing" in table and "| hybrid | sticky | " in table
    assert (out / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gguf = [json.loads(line) for line in (out / "gguf.jsonl").read_text().splitlines()]
    assert [(r["model"], r["backend"], r["cache_rate"]) for r in gguf] == [("synthetic:tiny?experts=q8_0", "hybrid", 0.5)]
    assert gguf[0]["ok"] and gguf[0]["decode_tok_s"] > 0
    assert "## GGUF experts (q8_0, 50 % cached" in table  # no baseline: the decode step served the demo
    assert f"\n| hybrid | {gguf[0]['decode_tok_s']:.1f} | – | – | " in table
    assert "benchmarks.bench_decode_moe" in table and "bench_resident_decode" not in table  # skipped, not shown


def test_table_marks_failed_rows_and_missing_bounds():
    scale = SCALES["tiny"]
    decode = [{"backend": "resident", "cache_rate": None, "ok": True, "decode_tok_s": 10.0, "ttft_ms": 5.0},
              {"backend": "hybrid", "cache_rate": 0.5, "ok": True, "decode_tok_s": 4.0, "bound_tok_s": 8.0,
               "bound_ratio": 0.5, "miss_rate": 0.3},
              {"backend": "hybrid", "cache_rate": 0.5, "ok": True, "decode_tok_s": 6.0, "bound_tok_s": 8.0},
              {"backend": "cpu", "cache_rate": 0.25, "ok": False, "error": "server exited"}]
    results = {"ceilings": {"cpu_read_sum_fp32_GBs": 9.0}, "decode": decode, "serving": [], "resident": None}
    rows = headline_rows(scale, results)
    assert rows[1]["tok_s"] == 5.0 and rows[1]["servers"] == 2 and rows[1]["bound_ratio"] == pytest.approx(5 / 8)
    assert rows[2]["tok_s"] is None and rows[2]["servers"] == 0
    table = markdown(scale, "demo", results, {"decode": ["python -m benchmarks.bench_decode_moe ..."]})
    assert "| hybrid | 50 % | – | 5.0 | 8.0 | 0.62 |" in table
    assert "failed: server exited" in table and "| cpu_read_sum_fp32_GBs | 9.0 |" in table
    for row in decode:
        row["model"] = "synthetic:tiny?layers=2"
    gguf = "synthetic:tiny?layers=2&experts=q8_0"
    results["gguf"] = [{"model": gguf, "backend": "hybrid", "cache_rate": 0.5, "ok": True, "decode_tok_s": 7.5,
                        "bound_tok_s": 15.0, "bound_ratio": 0.5},
                       {"model": gguf, "backend": "resident", "cache_rate": None, "ok": True, "decode_tok_s": 12.0},
                       {"model": gguf, "backend": "offload", "cache_rate": 0.5, "ok": False, "error": "out of memory"}]
    table = markdown(scale, "demo", results, {})
    assert "| hybrid | 7.5 | 5.0 | 1.50 | 15.0 | 0.50 |" in table  # beside the mean of the decode step's two
    assert "| resident | 12.0 | 10.0 | 1.20 | – | – |" in table
    assert "| offload | failed: out of memory |" in table
    decode[0]["model"] = "demo"  # another model's rows are no baseline
    assert "| resident | 12.0 | – | – | – | – |" in markdown(scale, "demo", results, {})
