"""benchmarks/bench_hybrid_split.py as a tool: a CPU smoke run of every config kind on Qwen3-30B-A3B's
routing geometry at an eighth of the width (the numbers themselves live in docs/results/history.md)."""

import json
import re

import pytest

from benchmarks.bench_hybrid_split import main


def test_every_config_kind_runs_and_reports_its_split(tmp_path):
    out, png = tmp_path / "split.json", tmp_path / "split.png"
    rc = main(["--device", "cpu", "--model", "synthetic:qwen3-moe-mini", "--cache-rate", "0.25",
               "--configs", "offload,cpu,hybrid:1,hybrid,offload+p8,hybrid:1+p2+t1,hybrid:1+lru,hybrid:1+c16", "--tokens", "12", "--warmup", "30",
               "--prompt-len", "16", "--max-seq-len", "128", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"offload", "cpu", "hybrid:1", "hybrid", "offload+p8", "hybrid:1+p2+t1", "hybrid:1+lru",
                         "hybrid:1+c16"}
    assert not any("error" in r for r in rows.values())
    for r in rows.values():
        assert r["tok_s"] > 0 and r["ms_p50"] <= r["ms_p99"]
        assert 0 < r["misses_per_layer"] <= 8 and r["fetched_per_layer"] <= r["misses_per_layer"] + 1e-9
    assert rows["offload"]["fetched_per_layer"] == rows["offload"]["misses_per_layer"]  # every miss fetched
    assert rows["cpu"]["fetched_per_layer"] == 0  # no fetch during cpu decode
    assert rows["hybrid:1"]["fetched_per_layer"] <= 1 and rows["hybrid:1"]["prefetched_per_layer"] == 0
    # prefetch: copies ahead (the last layer never: 3 of 4 layers), this synthetic model's misses drop
    assert 0 < rows["offload+p8"]["prefetched_per_layer"] <= 8 * 3 / 4
    assert rows["offload+p8"]["misses_per_layer"] < rows["offload"]["misses_per_layer"]
    assert 0 < rows["hybrid:1+p2+t1"]["prefetched_per_layer"] <= 2 and rows["hybrid:1+p2+t1"]["fetched_per_layer"] <= 1
    assert rows["hybrid:1+lru"]["fetched_per_layer"] <= 1 and rows["hybrid:1+lru"]["cache_policy"] == "lru"
    assert rows["hybrid:1"]["cache_policy"] == "lfu" and rows["hybrid:1"]["lfu_cap"] == 1024  # the engine's defaults
    assert rows["hybrid:1+c16"]["lfu_cap"] == 16
    assert rows["offload+p8"]["cache_policy"] == "lru"  # ... but lru where the prefetch needs it
    assert report["slots"] == round(0.25 * 4 * 128) and png.stat().st_size > 0
    again = tmp_path / "again.png"  # --replot: the table and plot of a saved run, nothing loaded
    assert main(["--replot", str(out), "--plot", str(again)]) == 0 and again.stat().st_size > 0


def test_a_bad_config_is_named_before_anything_loads():
    for bad in ("hybird", "cpu:2", "hybrid:x", "hybrid+q2", "offload+p", "hybrid+p2+p3", "cpu+w2", "offload+p1+lfu", "hybrid+lru+lfu",
                "hybrid+c1", "hybrid+c2000"):
        with pytest.raises(SystemExit, match=re.escape(f"unknown config '{bad}'")):
            main(["--device", "cpu", "--configs", f"offload,{bad}"])


def test_fp8_experts_run_every_data_path(tmp_path):
    """--moe-expert-dtype fp8: the miss copy, the next-layer prefetch and the CPU executor run on fp8_block banks."""
    out = tmp_path / "fp8.json"
    rc = main(["--device", "cpu", "--model", "synthetic:qwen3-moe-mini", "--moe-expert-dtype", "fp8", "--cache-rate",
               "0.25", "--configs", "offload+p8,cpu,hybrid", "--tokens", "8", "--warmup", "16", "--prompt-len", "8",
               "--max-seq-len", "64", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["expert_format"] == "fp8_block"
    rows = {r["config"]: r for r in report["rows"]}
    assert rows["offload+p8"]["prefetched_per_layer"] > 0
    assert rows["cpu"]["misses_per_layer"] > 0 and rows["cpu"]["fetched_per_layer"] == 0


def test_cpu_and_hybrid_rows_read_the_measured_buckets_split(tmp_path):
    """The rows of the CPU-side configs come from the split state of bucket 1 (bs=1 decode), on the CPU
    smoke path as on the GPU: a bench that reads a backend attribute the engine dropped fails here, not on
    the H200 (it once read one ``tuner`` after the split moved to one tuner per batch-size bucket)."""
    out = tmp_path / "tiny.json"
    rc = main(["--device", "cpu", "--model", "synthetic:tiny", "--cache-rate", "0.25", "--configs",
               "offload,cpu,hybrid:1,hybrid", "--tokens", "4", "--warmup", "30", "--prompt-len", "8",
               "--max-seq-len", "64", "--json", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert not [r["error"] for r in rows.values() if "error" in r] and rc == 0
    assert all(r["tok_s"] > 0 and r["misses_per_layer"] > 0 for r in rows.values())
    for config in ("cpu", "hybrid:1", "hybrid"):
        r = rows[config]
        assert 0.0 <= r["fetch_fraction"] <= 1.0 and r["bucket_steps"] >= 30 and r["c_sync_us"] > 0
        assert r["cpu_experts_per_layer"] > 0 and r["cpu_job_us"] > 0 and r["executor_error"] is None
    assert rows["cpu"]["fetch_fraction"] == 0.0 and rows["cpu"]["split_mode"] == "cpu"
    assert rows["hybrid"]["tuner"] is not None  # 30 steps: past TUNE_AFTER_STEPS, the bucket's tuner runs
    assert "fetch_fraction" not in rows["offload"]


def test_replot_with_ceilings_adds_each_rows_bounds(tmp_path, capsys):
    """--replot of a file written before the bounds (no moe_layers: the synthetic preset's spec gives 24)
    with the same machine's ceilings: offload over the PCIe gather, hybrid over PCIe + CPU at once, and the
    serial-aware bound that also counts hybrid's measured serial part per layer."""
    eb = 4_000_000
    report = {"model": "synthetic:qwen3-30b-a3b?layers=24", "device": "H200", "cache_rate": 0.33, "expert_bytes": eb,
              "rows": [{"config": "offload", "tok_s": 40.0, "misses_per_layer": 5.0, "prefetched_per_layer": 0.0},
                       {"config": "hybrid", "tok_s": 100.0, "misses_per_layer": 5.0, "prefetched_per_layer": 0.0,
                        "serial_us": 50.0}]}
    path, ceilings = tmp_path / "run.json", tmp_path / "ceilings.json"
    path.write_text(json.dumps(report))
    ceilings.write_text(json.dumps({"h2d_gather_8x9.4MB_GBs": 48.0, "overlap_pcie_GBs": 40.0, "overlap_cpu_read_GBs": 80.0}))
    assert main(["--replot", str(path), "--ceilings", str(ceilings)]) == 0
    per_token = 5 * 24 * eb  # 0.48 GB of missed experts a token
    offload_bound, hybrid_bound = 48e9 / per_token, 120e9 / per_token  # 100 and 250 tok/s
    serial_aware = 1 / (1 / hybrid_bound + 24 * 50e-6)  # 4 ms of bytes + 1.2 ms serial: 192.3 tok/s
    lines = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()}
    assert lines["offload"][-3:] == [f"{offload_bound:.1f}", f"{40 / offload_bound:.2f}", "-"]
    assert lines["hybrid"][-3:] == [f"{hybrid_bound:.1f}", f"{100 / hybrid_bound:.2f}", f"{100 / serial_aware:.2f}"]


def test_a_bad_ceilings_file_is_named_before_anything_loads(tmp_path):
    bad = tmp_path / "ceilings.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="no positive value"):
        main(["--device", "cpu", "--configs", "offload", "--ceilings", str(bad)])
