"""Compile kernels/moe_gemm.py's kernels for sm_90 with the Triton wheel's own ptxas, no GPU needed: bf16,
fp8_block and mxfp4 weights, silu and gpt-oss (biases, clamped SwiGLU), every launch config of the default
table; and kernels/moe_gemv.py's in the same formats; then both on each GGUF block type (silu, the GEMM's table, the
GEMV at GGUF_LAUNCH's entry for each row alignment). What the interpreter lets through but the compiler
rejects (a dot on a shape or dtype the tensor cores lack, a constexpr passed the wrong way) fails here. Run
by test_compile_sm90.py in a process of its own (TRITON_INTERPRET unset); prints one line per compiled kernel."""

import inspect
import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert not os.environ.get("TRITON_INTERPRET"), "the compiler, not the interpreter: unset TRITON_INTERPRET"

import kernels.moe_gemm as mg  # noqa: E402
import kernels.moe_gemv as gv  # noqa: E402
from services.engine.moe.gguf_quant import KERNEL_CODE  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # the H200


SHARED_MAX = 227 * 1024  # sm_90's shared memory per block (opt-in maximum)


def compile_kernel(kernel, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int) -> int:
    """Cubin bytes of ``kernel``: ``pointers`` name -> Triton pointer type, other non-constexpr params i32.
    Fails when the launch would need more shared memory than the H200 has."""
    params = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in params}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    shared = compiled.metadata.shared
    assert shared <= SHARED_MAX, f"{kernel.fn.__name__} {constexprs}: {shared} bytes of shared memory > {SHARED_MAX}"
    return len(compiled.asm["cubin"])


def main() -> None:
    n = compile_kernel(mg._count_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32"}, {"BLOCK_R": 256}, 4, 3)
    print(f"count: {n} bytes")
    for block_m in sorted({cfg.block_m for cfg in mg.all_configs(torch.device("cpu"))}):
        n = compile_kernel(mg._place_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "routes_ptr": "*i32",
                                              "tiles_ptr": "*i32"}, {"BLOCK_M": block_m, "BLOCK_R": 256,
                                                                     "BLOCK_E": 256}, 4, 3)
        print(f"place m{block_m}: {n} bytes")
    n = compile_kernel(mg._combine_kernel, {"y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16"},
                       {"BLOCK": 256}, 4, 3)
    print(f"combine: {n} bytes")
    for fmt, w, s in (("bf16", "*bf16", "*bf16"), ("fp8", "*fp8e4nv", "*fp32"), ("mxfp4", "*u8", "*u8")):
        for gpt_oss in (False, True):
            for cfg in mg.all_configs(torch.device("cpu")):  # the default table (what an untuned device gets)
                common = {"SB": mg.SCALE_BLOCK, "FP8": fmt == "fp8", "MX": fmt == "mxfp4", "HAS_BIAS": gpt_oss,
                          "IEEE": False, "BLOCK_M": cfg.block_m, "GQ": 0}
                n1 = compile_kernel(mg._gate_up_kernel,
                                    {"x_ptr": "*bf16", "routes_ptr": "*i32", "tiles_ptr": "*i32", "w_ptr": w,
                                     "s_ptr": s, "b_ptr": "*bf16", "act_ptr": "*bf16"},
                                    {**common, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "CLAMPED": gpt_oss,
                                     "ALPHA": 1.702, "LIMIT": 7.0}, cfg.num_warps, cfg.num_stages)
                n2 = compile_kernel(mg._down_kernel,
                                    {"act_ptr": "*bf16", "routes_ptr": "*i32", "tiles_ptr": "*i32", "w_ptr": w,
                                     "s_ptr": s, "b_ptr": "*bf16", "rw_ptr": "*fp32", "y_ptr": "*fp32"},
                                    {**common, "BLOCK_N": cfg.block_n2, "BLOCK_K": cfg.block_k2},
                                    cfg.num_warps, cfg.num_stages)
                print(f"gate_up/down {fmt} gpt_oss={gpt_oss} m{cfg.block_m}: {n1} {n2} bytes")
    # the GEMV (kernels/moe_gemv.py) in every weight format, plain and gpt-oss
    for quant, w, s in ((gv.PLAIN, "*bf16", "*bf16"), (gv.FP8, "*fp8e4nv", "*fp32"), (gv.MXFP4, "*u8", "*u8")):
        for gpt_oss in (False, True):
            n1 = compile_kernel(gv._gate_up_act_kernel,
                                {"x_ptr": "*bf16", "ids_ptr": "*i64", "gate_up_ptr": w, "act_ptr": "*fp32",
                                 "gs_ptr": s, "gb_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"},
                                {"BLOCK_I": gv.BLOCK_I, "BLOCK_K": gv.BLOCK_K1, "QUANT": quant, "SB": gv.SCALE_BLOCK,
                                 "BIAS": gpt_oss, "CLAMP": gpt_oss, "QT": 0, "ALIGN": 1, "X_ALIGN8": True}, 4, 3)
            n2 = compile_kernel(gv._down_kernel,
                                {"act_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "down_ptr": w,
                                 "y_ptr": "*fp32", "ds_ptr": s, "db_ptr": "*bf16"},
                                {"BLOCK_D": gv.BLOCK_D, "BLOCK_K": gv.BLOCK_K2, "QUANT": quant, "SB": gv.SCALE_BLOCK,
                                 "BIAS": gpt_oss, "QT": 0, "ALIGN": 1, "X_ALIGN8": True}, 4, 3)
            print(f"gemv quant={quant} gpt_oss={gpt_oss}: {n1} {n2} bytes")
    # GGUF banks (uint8 blocks, no scale banks): each type through the GEMM's table and the GEMV, silu
    for qtype, code in KERNEL_CODE.items():
        for cfg in mg.all_configs(torch.device("cpu")):
            common = {"SB": mg.SCALE_BLOCK, "FP8": False, "MX": False, "HAS_BIAS": False, "IEEE": False,
                      "BLOCK_M": cfg.block_m, "GQ": code}
            n1 = compile_kernel(mg._gate_up_kernel,
                                {"x_ptr": "*bf16", "routes_ptr": "*i32", "tiles_ptr": "*i32", "w_ptr": "*u8",
                                 "s_ptr": "*u8", "b_ptr": "*u8", "act_ptr": "*bf16"},
                                {**common, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "CLAMPED": False,
                                 "ALPHA": 1.702, "LIMIT": 7.0}, cfg.num_warps, cfg.num_stages)
            n2 = compile_kernel(mg._down_kernel,
                                {"act_ptr": "*bf16", "routes_ptr": "*i32", "tiles_ptr": "*i32", "w_ptr": "*u8",
                                 "s_ptr": "*u8", "b_ptr": "*u8", "rw_ptr": "*fp32", "y_ptr": "*fp32"},
                                {**common, "BLOCK_N": cfg.block_n2, "BLOCK_K": cfg.block_k2},
                                cfg.num_warps, cfg.num_stages)
            print(f"gguf gate_up/down {qtype.value} m{cfg.block_m}: {n1} {n2} bytes")
        sizes = []
        gate_up_launch, down_launch = gv.GGUF_LAUNCH[qtype]
        for align in (4, 2, 1):  # the row alignments the launcher picks load widths for (gv.row_alignment)
            sizes.append(compile_kernel(
                gv._gate_up_act_kernel,
                {"x_ptr": "*bf16", "ids_ptr": "*i64", "gate_up_ptr": "*u8", "act_ptr": "*fp32", "gs_ptr": "*u8",
                 "gb_ptr": "*u8", "alpha": "fp32", "limit": "fp32"},
                {"BLOCK_I": gate_up_launch.rows, "BLOCK_K": gv.BLOCK_K1, "QUANT": gv.GGUF, "SB": gv.SCALE_BLOCK,
                 "BIAS": False, "CLAMP": False, "QT": code, "ALIGN": align, "X_ALIGN8": True},
                gate_up_launch.num_warps, 3))
            sizes.append(compile_kernel(
                gv._down_kernel,
                {"act_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "down_ptr": "*u8", "y_ptr": "*fp32",
                 "ds_ptr": "*u8", "db_ptr": "*u8"},
                {"BLOCK_D": down_launch.rows, "BLOCK_K": gv.BLOCK_K2, "QUANT": gv.GGUF, "SB": gv.SCALE_BLOCK,
                 "BIAS": False, "QT": code, "ALIGN": align, "X_ALIGN8": True}, down_launch.num_warps, 3))
        print(f"gguf gemv {qtype.value}: {' '.join(map(str, sizes))} bytes (row alignment 4, 2, 1)")


if __name__ == "__main__":
    main()
