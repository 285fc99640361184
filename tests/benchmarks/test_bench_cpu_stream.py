"""benchmarks/bench_cpu_stream.py as a tool: a small CPU run gives a row per page size and prefetch setting,
with the page size really used; bad settings are named before anything is allocated (the numbers
themselves live in docs/results/history.md)."""

import json

import pytest

from benchmarks.bench_cpu_stream import main
from tests.engine.moe.test_banks import thp_mode


def test_small_run_reports_every_setting(tmp_path, capsys):
    # 64 experts: 8 + 4 MiB of bank, so whole 2 MiB pages cover most of each mapping (which also holds up to
    # 2 MiB of alignment slack) wherever mmap places it; with 16 the 1 MiB down bank fits a huge page only
    # when its mapping lands near a 2 MiB boundary, and the share swung between 0.29 and 0.57
    out = tmp_path / "stream.json"
    assert main(["--experts", "64", "--hidden", "256", "--intermediate", "128", "--threads", "1", "--rounds", "1",
                 "--seconds", "0.05", "--prefetch", "4096:l2,0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["pages"], r["prefetch"], r["allocation"]) for r in rows] == [
        ("huge", "4096:l2", 0), ("huge", "0", 0), ("small", "4096:l2", 0), ("small", "0", 0)]
    for r in rows:
        assert r["alone_best_gbs"] >= r["alone_median_gbs"] > 0
        assert "cpu_ov_median_gbs" not in r  # no GPU here: no gather beside it
    if thp_mode() == "madvise":  # the A/B is real: advised banks in huge pages, the others not
        assert rows[0]["huge_page_share"] > 0.5 and rows[2]["huge_page_share"] == 0
    assert "4096:l2" in capsys.readouterr().out


def test_allocations_measure_each_bank(tmp_path):
    """--allocations 2: two banks of one page size, both alive at once, each with a row per setting."""
    out = tmp_path / "stream.json"
    assert main(["--experts", "16", "--hidden", "256", "--intermediate", "128", "--threads", "1", "--rounds", "1",
                 "--seconds", "0.05", "--prefetch", "0", "--pages", "huge", "--allocations", "2",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["pages"], r["allocation"]) for r in rows] == [("huge", 0), ("huge", 1)]
    assert all(r["alone_median_gbs"] > 0 for r in rows)


@pytest.mark.parametrize("args, named", [(["--prefetch", "fast"], "stream prefetch"),
                                         (["--pages", "giant"], "--pages"),
                                         (["--allocations", "0"], "--allocations")])
def test_bad_settings_are_named(args, named, capsys):
    with pytest.raises(SystemExit):
        main(args)
    assert named in capsys.readouterr().err

