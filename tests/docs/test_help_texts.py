"""`--help` says what a flag does and its default, not which benchmark run measured it: no command's help
cites a run of the results notebook or a file outside the repository."""

from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

from services.cli import COMMANDS

BENCHMARK_MAINS = ["benchmarks.suite", "benchmarks.ceilings", "benchmarks.bench_decode_moe", "benchmarks.bench_serving",
                   "benchmarks.bench_resident_decode", "benchmarks.bench_hybrid_split", "benchmarks.bench_gemv",
                   "benchmarks.bench_cpu_executor", "benchmarks.bench_cpu_stream", "benchmarks.sim_expert_cache",
                   "benchmarks.plot_decode", "benchmarks.count_decode_ops",
                   "benchmarks.prefill_host_time",
                   "services.profiler.compare"]
TARGETS = sorted({target.split(":")[0] for target, _ in COMMANDS.values()} | set(BENCHMARK_MAINS))
NOTEBOOK = re.compile(r"\bruns? \d+|history\.md|benchmarks\.md|physlimits|(?-i:DESIGN" r"\.md)", re.IGNORECASE)


def help_text(module_name: str) -> str:
    main = importlib.import_module(module_name).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("module_name", TARGETS)
def test_help_cites_no_run(module_name):
    text = help_text(module_name)
    assert "usage:" in text
    assert NOTEBOOK.findall(text) == []


def test_the_pattern_catches_a_run_citation():
    assert NOTEBOOK.findall("lfu missed 8-12 % less on the H200 (runs 35-38)") == ["runs 35"]
    assert NOTEBOOK.findall("see docs/results/history.md run 12") == ["history.md", "run 12"]
