"""benchmarks/bench_cpu_warm.py as a tool: a small run reports cold and warm rates per job size and the
caches it found; bad --experts-per-job values are named (the numbers themselves live in docs/results/history.md)."""

import json

import pytest

from benchmarks.bench_cpu_warm import main


def test_small_run_reports_cold_and_warm(tmp_path):
    out = tmp_path / "warm.json"
    assert main(["--experts", "8", "--hidden", "256", "--intermediate", "128", "--dtype", "float32",
                 "--experts-per-job", "1,3", "--reps", "2", "--flush-mib", "16", "--threads", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["experts"] for r in report["rows"]] == [1, 3] and report["threads"] == 1
    for r in report["rows"]:
        assert r["bytes"] == r["experts"] * report["expert_bytes"] and r["cold_gbs"] > 0 and r["warm_gbs"] > 0
        assert r["speedup"] == pytest.approx(r["warm_gbs"] / r["cold_gbs"])


@pytest.mark.parametrize("bad", ["0", "1,x", "99"])
def test_bad_job_sizes_are_named(bad, capsys):
    with pytest.raises(SystemExit):
        main(["--experts", "8", "--experts-per-job", bad])
    assert "--experts-per-job" in capsys.readouterr().err
