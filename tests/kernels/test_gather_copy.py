"""copy_missing: the fused Triton copy (interpreted without a GPU) against the per-bank torch copy and
against the expected slot contents."""

import pytest
import torch

from kernels.gather_copy import CopyPlan, copy_fused, copy_per_bank


def make_banks(L, E, S, D, I, dtype, device, gen):
    pin = device.type == "cuda"
    host = []
    for _ in range(L):
        layer = {"gate_up": torch.randn(E, 2 * I, D, generator=gen).to(dtype),
                 "down": torch.randn(E, D, I, generator=gen).to(dtype)}
        host.append({k: (v.pin_memory() if pin else v) for k, v in layer.items()})
    slots = {k: torch.full((S, *v.shape[1:]), -7.0, dtype=dtype, device=device) for k, v in host[0].items()}
    return host, slots


# (L, E, S, D, I, dtype, jobs): 16-byte aligned sizes, odd sizes (byte path), a bank over one chunk (64 KiB)
CASES = [
    (3, 5, 7, 8, 4, torch.float32, 4),
    (2, 6, 9, 5, 3, torch.bfloat16, 6),
    (1, 3, 3, 5, 7, torch.float32, 0),
    (2, 4, 5, 96, 96, torch.float32, 3),
]


@pytest.mark.parametrize("L,E,S,D,I,dtype,n", CASES)
def test_fused_matches_per_bank(L, E, S, D, I, dtype, n, device):
    gen = torch.Generator().manual_seed(S * 31 + n)
    host, slots_a = make_banks(L, E, S, D, I, dtype, device, gen)
    slots_b = {k: v.clone() for k, v in slots_a.items()}
    C = min(E, S)
    job_src = torch.randperm(L * E, generator=gen)[:C].int().to(device)
    job_dst = torch.randperm(S, generator=gen)[:C].int().to(device)
    job_count = torch.tensor([n], dtype=torch.int32, device=device)
    plan_a, plan_b = CopyPlan(host, slots_a), CopyPlan(host, slots_b)
    assert plan_a.vec == (16 if (2 * I * D * dtype.itemsize) % 16 == 0 and (D * I * dtype.itemsize) % 16 == 0 else 1)
    copy_fused(plan_a, job_src, job_dst, job_count)
    copy_per_bank(plan_b, job_src, job_dst, job_count)
    if device.type == "cuda":
        torch.cuda.synchronize()
    copied = dict(zip(job_dst[:n].tolist(), job_src[:n].tolist()))
    for name in slots_a:
        a, b = slots_a[name].cpu(), slots_b[name].cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        for s in range(S):
            if s in copied:
                f = copied[s]
                want = host[f // E][name][f % E]
            else:  # slots without a job (including job entries past job_count) are untouched
                want = torch.full_like(a[s], -7.0)
            assert torch.equal(a[s].view(torch.uint8), want.cpu().view(torch.uint8)), f"{name} slot {s}"


def test_plan_refuses_mismatched_banks():
    host = [{"gate_up": torch.zeros(2, 4, 3), "down": torch.zeros(2, 3, 2)}]
    slots = {"gate_up": torch.zeros(3, 4, 3), "down": torch.zeros(3, 3, 2, dtype=torch.float64)}
    with pytest.raises(ValueError, match="host bank 'down' of layer 0"):
        CopyPlan(host, slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cache_step_captured_in_cuda_graph_matches_reference():
    """ensure (Triton) + fused copy on CUDA, captured once per layer in a CUDA graph and replayed with new
    routes, against an ExpertCache on the CPU running the torch reference and the per-bank copy."""
    from services.engine.moe.banks import ExpertBanks, ExpertFormat, LayerBanks
    from services.engine.moe.cache import ExpertCache

    L, E, S, D, I, T, A = 3, 16, 9, 64, 32, 2, 4
    gen = torch.Generator().manual_seed(0)
    layers = [LayerBanks(ExpertFormat.UNQUANTIZED, {"gate_up": torch.randn(E, 2 * I, D, generator=gen).bfloat16(),
                                                    "down": torch.randn(E, D, I, generator=gen).bfloat16()})
              for _ in range(L)]
    ref = ExpertCache(ExpertBanks(layers), S, torch.device("cpu"))
    pinned = [LayerBanks(l.format, {k: v.pin_memory() for k, v in l.tensors.items()}) for l in layers]
    gpu = ExpertCache(ExpertBanks(pinned), S, torch.device("cuda"))
    assert gpu.use_triton and gpu.plan.vec == 16
    static_ids = torch.zeros(T, A, dtype=torch.int64, device="cuda")
    graphs, outs = [], []
    for layer in range(L):  # warm up (compile) on a scratch copy of the state, then capture
        saved = gpu.state.clone()
        gpu.ensure(layer, static_ids)
        gpu.copy_missing(max_jobs=T * A)
        torch.cuda.synchronize()
        for f in ("slot_of_id", "id_of_slot", "last_use", "clock", "hits", "misses", "fetched"):
            getattr(gpu.state, f).copy_(getattr(saved, f))
        for bank in gpu.slot_banks.values():
            bank.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = gpu.ensure(layer, static_ids)
            gpu.copy_missing(max_jobs=T * A)
        graphs.append(g)
        outs.append(out)
    for step in range(12):
        layer = step % L
        ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(T)])  # [T, A]
        static_ids.copy_(ids)
        graphs[layer].replay()
        want = ref.ensure(layer, ids)
        ref.copy_missing()
        torch.cuda.synchronize()
        assert torch.equal(outs[layer].cpu(), want), f"step {step}"
        for f in ("slot_of_id", "id_of_slot", "last_use", "clock", "hits", "misses", "fetched"):
            assert torch.equal(getattr(gpu.state, f).cpu(), getattr(ref.state, f)), f"{f} at step {step}"
        for name in ref.slot_banks:
            assert torch.equal(gpu.slot_banks[name].cpu(), ref.slot_banks[name]), f"{name} at step {step}"


def test_cache_copy_benchmark_smoke(tmp_path):
    """`tandem bench cache-copy` on the CPU torch paths: the table's rows and the JSON agree with the sweep."""
    import json

    from benchmarks.bench_offload_cache_copy import main

    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--profile", "tiny", "--bs", "1,8", "--miss-rate", "0,1", "--repeat", "1",
                 "--modes", "fused,per-bank", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # slots {E, 0.4*L*E} x modes x bs x miss rates
    assert {(r["bs"], r["miss_rate"], r["misses"]) for r in rows} == {(1, 0.0, 0), (1, 1.0, 4), (8, 0.0, 0), (8, 1.0, 16)}
