"""What handing a layer's work to the CPU executor and taking its result back costs on CUDA (c_sync, the
fixed per-layer term of the split's cost model, docs/design.md §1): a loop of tiny GPU ops that stand in
for a layer, with and without an empty CPU job (all ids -1) handed off per layer. Used by the profiler
(services/profiler/probes.py c_sync, the profile's prior) and by benchmarks/bench_cpu_executor.py."""

from __future__ import annotations

import time

import torch

from services.engine.moe.cpu_executor import CpuExecutor
from services.engine.moe.cpu_handoff import DeviceHandoff, GraphHandoff


def measure_c_sync_eager(ex: CpuExecutor, D: int, A: int, dtype: torch.dtype, fast: bool = True, layers: int = 48,
                         reps: int = 20) -> dict:
    """Fixed per-layer cost (seconds) of the eager handoff (DeviceHandoff submit + sync + the add of
    its result) on CUDA: a loop of ``layers`` tiny GPU ops with an empty CPU job (all ids -1) handed off
    per layer, minus the same loop without the handoff; best of ``reps``. ``fast``: the driver-API path
    (else torch copies). The profiler's c_sync (services/profiler/probes.py) is this number."""
    dev = torch.device("cuda")
    hand = DeviceHandoff(ex, dev, 1, D, A, dtype, fast=fast)
    x = torch.randn(1, D, device=dev, dtype=dtype)
    ids = torch.full((1, A), -1, dtype=torch.int64, device=dev)
    w = torch.rand(1, A, device=dev)

    def loop(handoff: bool) -> float:
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = x.float()
            for _layer in range(layers):
                y = y * 0.5 + 1.0  # stands in for the layer's GPU work
                if handoff:
                    hand.submit(0, x, ids, w)
                    y = y + hand.sync()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best / layers

    loop(True)
    with_handoff, without = loop(True), loop(False)
    return {"c_sync_s": with_handoff - without, "layer_with_handoff_s": with_handoff, "layer_gpu_only_s": without,
            "fast_path": hand.fast}


def measure_c_sync(ex: CpuExecutor, D: int, A: int, dtype: torch.dtype, layers: int = 48, reps: int = 20) -> dict:
    """c_sync of the eager handoff (fast path, and the torch path as c_sync_torch_s) and of graph mode."""
    res = measure_c_sync_eager(ex, D, A, dtype, True, layers, reps)
    torch_path = measure_c_sync_eager(ex, D, A, dtype, False, layers, reps)
    res.update(c_sync_torch_s=torch_path["c_sync_s"], layer_with_torch_handoff_s=torch_path["layer_with_handoff_s"])
    res.update(measure_c_sync_graph(ex, D, A, dtype, layers, reps))
    return res


def measure_c_sync_graph(ex: CpuExecutor, D: int, A: int, dtype: torch.dtype, layers: int, reps: int) -> dict:
    """The same per-layer cost with the capturable handoff (GraphHandoff), the layer loop captured in
    one CUDA graph and replayed: what a graph-mode decode step pays per layer."""
    dev = torch.device("cuda")
    hand = GraphHandoff(ex, dev, 1, D, A, dtype)
    try:
        x = torch.randn(1, D, device=dev, dtype=dtype)
        ids = torch.full((1, A), -1, dtype=torch.int64, device=dev)
        w = torch.rand(1, A, device=dev)

        def body(handoff: bool) -> torch.Tensor:
            y = x.float()
            for _ in range(layers):
                y = y * 0.5 + 1.0
                if handoff:
                    hand.submit(0, x, ids, w)
                    y = hand.sync_add(0, y)
            return y

        out = {}
        for handoff in (True, False):
            body(handoff)  # compile / warm up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body(handoff)
            best = float("inf")
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            out[handoff] = best / layers
        return {"c_sync_graph_s": out[True] - out[False], "graph_layer_with_handoff_s": out[True],
                "graph_layer_gpu_only_s": out[False], "graph_handoff_error": hand.poll_stats()["error"]}
    finally:
        hand.close()
