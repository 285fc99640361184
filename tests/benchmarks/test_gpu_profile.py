"""The kernel-family table of bench_resident_decode --profile-steps (benchmarks/gpu_profile.py), built from a fake
profiler event list (CI has no GPU), and the expert count of benchmarks/batch_step.py on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from benchmarks.batch_step import distinct_experts
from benchmarks.gpu_profile import OTHER, family_of, format_families, kernel_families, kernel_rows


def ev(key: str, count: int, us: float) -> SimpleNamespace:
    return SimpleNamespace(key=key, count=count, self_device_time_total=us)


# two steps of a 2-layer decode step as the H200's profiler names the kernels (docs/results/h200-2026-11-29)
EVENTS = [
    ev("_gate_up_act_kernel", 4, 2000.0), ev("_down_kernel", 4, 1000.0), ev("_combine_kernel", 4, 40.0),
    ev("_decode_attention_split_kernel", 4, 200.0), ev("_decode_attention_merge_kernel", 4, 40.0),
    ev("_rms_norm_kernel", 10, 100.0), ev("_qk_norm_rope_kernel", 4, 40.0), ev("_route_topk_kernel", 4, 60.0),
    ev("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 8, 300.0),
    ev("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16", 4, 20.0),
    ev("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso", 2, 10.0),
    ev("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<f", 2, 6.0),
    ev("cudaGraphLaunch", 2, 0.0),  # a runtime call, no device time: not a kernel row
]


def test_families_of_the_h200_kernel_names():
    assert family_of("_gate_up_act_kernel") == family_of("_gemv_kernel") == "expert GEMM/GEMV"
    assert family_of("_decode_attention_split_kernel") == "attention"
    assert family_of("void cublasLt::splitKreduce_kernel<32>") == "dense matmul (cuBLAS)"
    assert family_of("_route_topk_kernel") == "router/top-k"
    assert family_of("_copy_jobs_kernel") == "expert staging (hybrid/offload)"
    assert family_of("void at::native::reduce_kernel<ArgMaxOps>") == OTHER


def test_table_sums_kernels_per_step_into_families_with_shares():
    rows = kernel_rows(EVENTS, steps=2)
    assert len(rows) == 12 and rows[0]["kernel"] == "_gate_up_act_kernel" and rows[0]["us_per_step"] == 1000
    table = kernel_families(rows, wall_us=2000.0)
    fams = {f["family"]: f for f in table["families"]}
    assert table["gpu_busy_us"] == 1908.0 and table["idle_us"] == 92.0
    assert fams["expert GEMM/GEMV"]["us_per_step"] == 1520 and fams["expert GEMM/GEMV"]["launches_per_step"] == 6
    assert fams["attention"]["us_per_step"] == 120 and fams["norms + rope"]["us_per_step"] == 70
    assert fams["dense matmul (cuBLAS)"]["us_per_step"] == 160 and fams["copies"]["us_per_step"] == 5
    assert fams["router/top-k"]["us_per_step"] == 30 and fams[OTHER]["us_per_step"] == 3
    assert table["families"][0]["family"] == "expert GEMM/GEMV"  # by time
    assert abs(sum(f["share_of_busy"] for f in table["families"]) - 1) < 1e-9
    assert fams["expert GEMM/GEMV"]["share_of_step"] == 1520 / 2000
    text = format_families("t", table)
    assert "expert GEMM/GEMV" in text and "GPU busy 1908 us/step of 2000 us wall (95%; idle 92 us)" in text


def test_table_without_wall_time():
    table = kernel_families(kernel_rows(EVENTS[:2], steps=1))
    assert table["wall_us"] is None and table["families"][0]["share_of_step"] is None
    assert "GPU busy 3000 us/step" in format_families("t", table)


def test_distinct_experts_counts_each_layers_routed_experts():
    calls = []

    class Backend:
        def forward(self, moe_layer, hidden, topk_ids, topk_weights):
            calls.append(moe_layer)
            return hidden

    backend = Backend()

    def step():
        backend.forward(0, None, torch.tensor([[1, 2], [2, 3]]), None)
        backend.forward(1, None, torch.tensor([[5, -1], [5, 5]]), None)  # -1: a skipped route

    assert distinct_experts(backend, step) == [3, 1]
    assert calls == [0, 1] and "forward" not in vars(backend)  # the wrapper is gone again
