"""The expert-cache kernels and the grouped MoE GEMM compile for the H200 (sm_90) on a machine without a GPU; see
compile_ensure_sm90.py and compile_moe_gemm_sm90.py. A fresh Triton cache, so a kernel compiled before cannot stand in for this one."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ensure_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.kernels.compile_ensure_sm90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    for kernel in ("ensure_experts", "split_misses"):
        for lfu in (False, True):
            line = next(x for x in lines if x.startswith(f"{kernel} lfu={lfu}:"))
            assert int(line.split()[2]) > 0
    assert int(next(x for x in lines if x.startswith("wait_cpu_add")).split()[2]) > 0
    assert int(next(x for x in lines if x.startswith("copy_tiered")).split()[2]) > 0


def test_moe_gemm_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.kernels.compile_moe_gemm_sm90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [x for x in done.stdout.split("\n") if x.startswith("gate_up/down")]
    from kernels.moe_gemm import CONFIGS

    assert len(lines) == 3 * 2 * len(CONFIGS["default"])  # bf16/fp8/mxfp4 x silu/gpt-oss x the default table
    gemv = [x for x in done.stdout.split("\n") if x.startswith("gemv")]
    assert len(gemv) == 3 * 2  # bf16/fp8/mxfp4 x silu/gpt-oss
    gguf = [x for x in done.stdout.split("\n") if x.startswith("gguf ")]
    assert len(gguf) == 5 * (len(CONFIGS["default"]) + 1)  # q4_K/q5_K/q6_K/q8_0/mxfp4_gguf x (the table + the GEMV)
    assert all(int(n) > 0 for x in lines + gemv + gguf for n in x.split(":")[1].split()[:2])
