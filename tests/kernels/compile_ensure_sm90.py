"""Compile the expert-cache kernels (kernels/ensure_experts*.py, lru and lfu), the graph handoff's wait
kernel (kernels/cpu_handoff.py) and the peer tier's copy (kernels/peer_copy.py) for sm_90 with the Triton
wheel's own ptxas, no GPU needed: what the interpreter lets through but the compiler rejects (a branch on a
reduced value, a loop of runtime length) fails here. Run by test_compile_sm90.py in a process of its own,
since the kernel tests' TRITON_INTERPRET must stay unset here; prints one line per compiled kernel."""

import inspect
import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert not os.environ.get("TRITON_INTERPRET"), "the compiler, not the interpreter: unset TRITON_INTERPRET"

import kernels.cpu_handoff as handoff  # noqa: E402
import kernels.ensure_experts as ensure  # noqa: E402
import kernels.ensure_experts_hybrid as hybrid  # noqa: E402
import kernels.peer_copy as peer_copy  # noqa: E402
from kernels.ensure_experts_ref import USE_CAP, USE_SHIFT, CacheState  # noqa: E402

POINTER = {torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.bfloat16: "*bf16"}
TARGET = GPUTarget("cuda", 90, 32)  # the H200


def compile_kernel(kernel, tensors: dict[str, torch.Tensor], constexprs: dict) -> int:
    """Cubin bytes of ``kernel`` with pointers typed from ``tensors`` (by parameter name), the other
    non-constexpr parameters i32."""
    params = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constexprs else POINTER[tensors[n].dtype] if n in tensors else "i32"
                 for n in params}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": 4})
    return len(compiled.asm["cubin"])


def main() -> None:
    state = CacheState.allocate(24, 128, 1014, torch.device("cpu"))  # the 24-layer geometry at a third cached
    ids = torch.zeros(1, 8, dtype=torch.int64)
    tables = {f"{name}_ptr": getattr(state, name) for name in ("slot_of_id", "id_of_slot", "last_use", "clock",
              "job_src", "job_dst", "job_count", "hits", "misses", "fetched", "work", "uses")}
    split = hybrid._split_kernel()
    for lfu in (False, True):
        n = compile_kernel(ensure._ensure_experts_kernel,
                           {**tables, "topk_ids_ptr": ids, "slot_ids_ptr": ids.int()},
                           dict(BLOCK_N=ensure.ROUTES_BLOCK, BLOCK_E=128, BLOCK_S=1024, LFU=lfu, COUNT_USES=True,
                                USE_SHIFT=USE_SHIFT, USE_CAP=USE_CAP))
        print(f"ensure_experts lfu={lfu}: {n} bytes")
        n = compile_kernel(split, {**tables, "topk_ids_ptr": ids, "gpu_ids_ptr": ids, "cpu_ids_ptr": ids,
                                   "f_q16_ptr": torch.zeros(1, dtype=torch.int32), "prefer_ptr": state.slot_of_id},
                           dict(BLOCK_N=ensure.ROUTES_BLOCK, BLOCK_E=128, LFU=lfu, USE_CAP=USE_CAP, PREFER=lfu))  # a peer tier's table with lfu
        print(f"split_misses lfu={lfu}: {n} bytes")
    # the graph handoff's wait (one program per block of the CPU's output, each polling the done word)
    i64, f32, bf16 = (torch.zeros(1, dtype=t) for t in (torch.int64, torch.float32, torch.bfloat16))
    n = compile_kernel(handoff._kernels()[1],
                       {"seq_ptr": i64, "done_ptr": i64, "cpu_ptr": f32, "part_ptr": bf16, "out_ptr": bf16,
                        "stamps_ptr": i64, "misses_ptr": i64, "fetched_ptr": i64, "counters_ptr": i64},
                       dict(TIMER=True, COUNTERS=True, GPU=True, BLOCK=handoff.WAIT_BLOCK))
    print(f"wait_cpu_add lfu=None: {n} bytes")
    # the peer tier's two-source copy (kernels/peer_copy.py: a branch per job on the table's entry)
    u8, i32 = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32)
    n = compile_kernel(peer_copy._copy_tiered_kernel,
                       {"host_base": u8, "peer_base": u8, "dst_base": u8, "host_delta_ptr": i64, "peer_delta_ptr": i64,
                        "dst_delta_ptr": i64, "bank_bytes_ptr": i64, "job_src_ptr": i32, "job_dst_ptr": i32,
                        "job_count_ptr": i32, "peer_slot_ptr": i32, "peer_fetched_ptr": i64},
                       dict(CHUNK=peer_copy.CHUNK_BYTES, BLOCK=peer_copy.BLOCK_BYTES, VEC=16))
    print(f"copy_tiered lfu=None: {n} bytes")


if __name__ == "__main__":
    main()
