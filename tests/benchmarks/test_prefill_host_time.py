"""benchmarks/prefill_host_time runs end to end on the CPU (the H200 call is its real use)."""

from __future__ import annotations

from benchmarks.prefill_host_time import main, measure


def test_measures_a_tiny_prefill_on_the_cpu(capsys):
    r = measure("synthetic:tiny?layers=2", "cpu", prompt_len=8, prompts=2, repeats=2)
    assert r["layers"] == 2 and r["syncs"] == 0 and r["gpu_ms"] is None
    assert r["enqueue_ms"] > 0 and r["layer_host_us"]["mean"] > 0
    assert "F.linear qkv (cuBLAS)" in r["launch_host_us"] and "tottime" in r["profile"]
    assert main(["--model", "synthetic:tiny?layers=1", "--device", "cpu", "--prompt-len", "4"]) == 0
    assert "host per decoder layer" in capsys.readouterr().out
