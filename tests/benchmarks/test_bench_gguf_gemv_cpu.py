"""benchmarks/bench_gguf_gemv_cpu.py on a tiny shape: a row per type, ISA and input kind, each checked against
the torch reference before it is timed; int8 inputs for every type on the vector ISAs."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_gguf_gemv_cpu


def test_rows_per_type_isa_and_inputs(tmp_path):
    out = tmp_path / "rows.json"
    assert bench_gguf_gemv_cpu.main(["--rows", "40", "--cols", "512", "--tokens", "2", "--rounds", "1", "--calls", "1",
                                     "--types", "q4_K,q6_K,q8_0", "--isa", "avx2,scalar", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    kinds = {(r["type"], r["isa"], r["inputs"]) for r in rows}
    assert kinds == {("q4_K", "avx2", "int8"), ("q4_K", "avx2", "fp32"), ("q4_K", "scalar", "fp32"),
                     ("q6_K", "avx2", "int8"), ("q6_K", "avx2", "fp32"), ("q6_K", "scalar", "fp32"),
                     ("q8_0", "avx2", "int8"), ("q8_0", "avx2", "fp32"), ("q8_0", "scalar", "fp32")}
    assert all(r["max_rel_err"] <= 1e-5 and r["us_per_run"] > 0 and r["m"] == 40 for r in rows)


@pytest.mark.parametrize("args, message", [(["--cols", "300"], "multiple of 256"), (["--types", "q4_0"], "q4_0")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        bench_gguf_gemv_cpu.main(args)
    assert message in capsys.readouterr().err
