"""bench_peer_copy on the CPU (a simulated peer): one row per case, the peer's share of the jobs as asked, the
moved bytes and rate consistent; a peer of another device kind is refused."""

import json

import pytest

from benchmarks import bench_peer_copy
from services.profiler.bench_bw import geometry


def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert bench_peer_copy.main(["--device", "cpu", "--peer", "cpu", "--model", "tiny", "--reps", "2",
                                 "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    J = geometry("tiny").top_k
    assert [r["case"] for r in rows] == ["host-only copy_missing", "host", "half", "peer"]
    assert [r["from_peer"] for r in rows] == [0, 0, J // 2, J] and all(r["jobs"] == J for r in rows)
    for r in rows:
        assert r["GBps"] * r["us"] * 1e3 == pytest.approx(J * r["expert_bytes"])  # GB/s x us = kB
        assert r["linear_p2p_GBps"] > 0
    assert "linear peer->home copy" in capsys.readouterr().out


def test_mixed_device_kinds_are_refused(capsys):
    assert bench_peer_copy.main(["--device", "cpu", "--peer", "cuda:0", "--model", "tiny"]) == 2
    assert "one kind" in capsys.readouterr().err
