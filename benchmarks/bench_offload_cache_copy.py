"""Per-layer decode copy cost of the expert cache on synthetic banks (no checkpoint needed).

Drives the real kernels of the offload path — ``ensure_experts`` (LRU remap) + ``copy_missing`` (fused H2D
of every bank) — for one layer, over batch size x miss rate, and extrapolates to a token (``tok_ms`` =
time_ms x L, assuming every MoE layer has the same miss profile). In the same run it measures a linear
pinned H2D copy of the same bytes, the ceiling the fused gather is judged against (target >= 85%).

State per point (prepare_state): every slot belongs to another layer (so evictions do real work and
layer 0 never hits by accident), then ``active - misses`` of the step's experts are made hits;
``active = min(E, bs * A)``, ``misses = round(active * miss_rate)``. Timed with CUDA events, median of
--repeat (25) after 3 warm-ups; the state is restored before each repetition, outside the timed region.

    tandem bench cache-copy                                  # qwen3-30b-a3b, slots E and 0.4*L*E
    tandem bench cache-copy --profile mixtral-8x7b --modes fused,per-bank --json out.json
    tandem bench cache-copy --device cpu --profile tiny      # smoke run of the torch paths
    tandem bench cache-copy --decode synthetic:qwen3-30b-a3b --gpu-memory-limit 24   # + bs=1 decode tok/s

Columns: bs / active / miss_rate / misses / time_ms (ensure + copy) / copy_MiB / bw_GBps (copy_MiB over
time_ms) / tok_ms, plus slots, mode and copy_ms / copy_GBps (the copy alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from services.engine.moe.banks import ExpertBanks, ExpertFormat, LayerBanks

MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    num_layers: int  # L
    num_experts: int  # E
    top_k: int  # A
    hidden: int  # D
    intermediate: int  # I
    fmt: ExpertFormat = ExpertFormat.UNQUANTIZED
    dtype: torch.dtype = torch.bfloat16


# Geometries of the synthetic presets (services/engine/models/synthetic.py) and OLMoE; one per format as
# formats are added (the bank shapes come from BANK_SCHEMAS, the cache only moves rows).
PROFILES: dict[str, Profile] = {
    "qwen3-30b-a3b": Profile(48, 128, 8, 2048, 768),  # 9.4 MB experts
    "olmoe-1b-7b": Profile(16, 64, 8, 2048, 1024),
    "mixtral-8x7b": Profile(32, 8, 2, 4096, 14336),  # 352 MB experts
    "tiny": Profile(4, 16, 4, 64, 32, dtype=torch.float32),  # smoke runs on CPU
}


def synthetic_banks(p: Profile, pin: bool) -> tuple[ExpertBanks, dict]:
    """Layer 0's banks filled with random bits, then pinned (fill-then-pin); layers 1.. alias them (only
    layer 0 is driven, the others exist for the flat id space). Also times the two ways to pin."""
    layer0 = ExpertBanks.allocate(p.fmt, 1, p.num_experts, p.hidden, p.intermediate, p.dtype).layers[0]
    for t in layer0.tensors.values():
        t.view(torch.uint8).random_(0, 256)
    pin_info: dict = {}
    if pin:
        nbytes = sum(t.numel() * t.element_size() for t in layer0.tensors.values())
        t0 = time.perf_counter()
        pinned = {name: t.pin_memory() for name, t in layer0.tensors.items()}  # copy into new pinned memory
        pin_info["pin_memory_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        try:  # in place: page-lock the existing allocation, no copy (needs it to outlive the registration)
            cudart = torch.cuda.cudart()
            t0 = time.perf_counter()
            codes = [cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                     for t in layer0.tensors.values()]
            pin_info["host_register_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
            pin_info["host_register_result"] = [str(c) for c in codes]
            for t in layer0.tensors.values():
                cudart.cudaHostUnregister(t.data_ptr())
        except (AttributeError, RuntimeError) as e:
            pin_info["host_register_error"] = repr(e)
        layer0 = LayerBanks(p.fmt, pinned)
    return ExpertBanks([layer0] * p.num_layers), pin_info


def prepare_state(cache, active: int, hits: int) -> None:
    """Every slot owned by another layer with distinct LRU times; experts [0, hits) of layer 0 cached."""
    st, E, S = cache.state, cache.num_experts, cache.num_slots
    dev = st.slot_of_id.device
    st.slot_of_id.fill_(-1)
    owners = torch.arange(S, device=dev, dtype=torch.int32) + E  # flat ids of layers >= 1
    owners[:hits] = torch.arange(hits, device=dev, dtype=torch.int32)  # the hits: layer 0's first experts
    st.id_of_slot.copy_(owners)
    st.slot_of_id[owners.long()] = torch.arange(S, device=dev, dtype=torch.int32)
    st.last_use.copy_(torch.randperm(S, generator=torch.Generator().manual_seed(0)).to(dev) + 1)
    st.clock.fill_(S)


def route_ids(bs: int, A: int, active: int, device) -> torch.Tensor:
    """[bs, A] routes over exactly ``active`` unique experts (no repeat within a token)."""
    return (torch.arange(bs * A, device=device) % active).view(bs, A)


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def measure(self, setup, body, repeat: int, warmup: int = 3) -> float:
        """Median milliseconds of ``body`` (``setup`` runs before each call, untimed)."""
        times = []
        for i in range(warmup + repeat):
            setup()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                body()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                body()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(ms)
        return statistics.median(times)


def linear_h2d(nbytes: int, device: torch.device, timer: Timer, repeat: int) -> dict:
    """Pinned host -> device copy of one contiguous buffer (the PCIe ceiling of this run)."""
    if device.type != "cuda":
        return {}
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = timer.measure(lambda: None, lambda: dst.copy_(src, non_blocking=True), repeat)
    return {"bytes": nbytes, "time_ms": ms, "GBps": nbytes / ms / 1e6}


def run(args: argparse.Namespace) -> dict:
    from kernels.gather_copy import CopyMode
    from services.engine.moe.cache import ExpertCache

    device = torch.device(args.device)
    timer = Timer(device)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "repeat": args.repeat, "profiles": {}, "rows": []}
    for name in args.profile.split(","):
        p = PROFILES[name]
        banks, pin_info = synthetic_banks(p, pin=device.type == "cuda")
        expert_bytes = banks.expert_nbytes()
        linear = linear_h2d(8 * expert_bytes, device, timer, args.repeat)
        linear_1g = linear_h2d(1 << 30, device, timer, args.repeat)
        result["profiles"][name] = {**dataclasses.asdict(p), "fmt": p.fmt.value, "dtype": str(p.dtype),
                                    "expert_bytes": expert_bytes, "pin": pin_info,
                                    "linear_h2d_8_experts": linear, "linear_h2d_1GiB": linear_1g}
        LE = p.num_layers * p.num_experts
        sizes = {"__builtins__": {}, "E": p.num_experts, "L": p.num_layers}
        # at most L*E - E: prepare_state gives every slot to another layer than the driven one
        slot_counts = sorted({min(int(eval(s, sizes)), LE - p.num_experts) for s in args.slots.split(",")})
        points = [(S, m, bs, r) for S in slot_counts for m in args.modes.split(",")
                  for bs in map(int, args.bs.split(",")) for r in map(float, args.miss_rate.split(","))]
        cache, cache_slots = None, None
        for S, mode, bs, rate in tqdm(points, desc=f"cache-copy {name}", unit="pt"):
            if cache_slots != S:
                cache = None
                cache = ExpertCache(banks, S, device, use_triton=device.type == "cuda")
                cache_slots = S
            cache.copy_mode = CopyMode(mode)
            active = min(p.num_experts, bs * p.top_k)
            misses = round(active * rate)
            ids = route_ids(bs, p.top_k, active, device)
            snap = None

            def restore():
                nonlocal snap
                if snap is None:
                    prepare_state(cache, active, active - misses)
                    snap = cache.state.clone()
                for f in dataclasses.fields(snap):
                    getattr(cache.state, f.name).copy_(getattr(snap, f.name))

            copy = lambda: cache.copy_missing(max_jobs=ids.numel())  # noqa: E731 (as the offload layer calls it)
            ms = timer.measure(restore, lambda: (cache.ensure(0, ids), copy()), args.repeat)
            copy_ms = timer.measure(lambda: (restore(), cache.ensure(0, ids)), copy, args.repeat)
            assert int(cache.state.job_count[0]) == misses, "prepare_state: unexpected miss count"
            nbytes = misses * expert_bytes
            result["rows"].append({
                "profile": name, "slots": S, "mode": mode, "bs": bs, "active": active, "miss_rate": rate,
                "misses": misses, "time_ms": ms, "copy_MiB": nbytes / MiB, "bw_GBps": nbytes / ms / 1e6,
                "tok_ms": ms * p.num_layers, "copy_ms": copy_ms, "copy_GBps": nbytes / copy_ms / 1e6})
        del cache
        result["summary_" + name] = summary(result["rows"], name, p, linear)
    return result


def summary(rows: list[dict], name: str, p: Profile, linear: dict) -> dict:
    """The target line: the fused copy of one token's experts all missing vs linear pinned H2D."""
    full = [r for r in rows if r["profile"] == name and r["mode"] == "fused" and r["misses"] == p.top_k
            and r["bs"] == 1]
    if not full or not linear:
        return {}
    r = min(full, key=lambda r: r["copy_ms"])
    return {"misses": r["misses"], "copy_GBps": r["copy_GBps"], "ensure_plus_copy_GBps": r["bw_GBps"],
            "linear_GBps": linear["GBps"], "copy_share_of_linear": r["copy_GBps"] / linear["GBps"],
            "ensure_plus_copy_share_of_linear": r["bw_GBps"] / linear["GBps"]}


COLUMNS = ["profile", "slots", "mode", "bs", "active", "miss_rate", "misses", "time_ms", "copy_MiB", "bw_GBps",
           "tok_ms", "copy_ms", "copy_GBps"]


def print_table(result: dict) -> None:
    print(f"device: {result['device']}   (median of {result['repeat']})")
    for name, prof in result["profiles"].items():
        lin, lin1g = prof["linear_h2d_8_experts"], prof["linear_h2d_1GiB"]
        line = f"{name}: expert {prof['expert_bytes'] / 1e6:.2f} MB"
        if lin:
            line += f"; linear pinned H2D {lin['GBps']:.1f} GB/s (8 experts), {lin1g['GBps']:.1f} GB/s (1 GiB)"
        if prof["pin"]:
            line += f"; pin_memory copy {prof['pin']['pin_memory_GBps']:.1f} GB/s"
            if "host_register_GBps" in prof["pin"]:
                line += f", cudaHostRegister {prof['pin']['host_register_GBps']:.1f} GB/s"
        print(line)
    print(" ".join(f"{c:>13}" for c in COLUMNS))
    for r in result["rows"]:
        print(" ".join(f"{r[c]:>13.3f}" if isinstance(r[c], float) else f"{r[c]!s:>13}" for c in COLUMNS))
    for name in result["profiles"]:
        s = result.get("summary_" + name)
        if s:
            print(f"{name}: fused copy of {s['misses']} missing experts = {s['copy_GBps']:.1f} GB/s = "
                  f"{s['copy_share_of_linear']:.1%} of linear pinned H2D ({s['linear_GBps']:.1f} GB/s); "
                  f"ensure + copy {s['ensure_plus_copy_share_of_linear']:.1%} (target >= 85%)")


def decode_run(args: argparse.Namespace, pcie_GBps: float | None) -> dict:
    """bs=1 greedy decode of the `offload` backend on ``args.decode`` (e.g. synthetic:qwen3-30b-a3b) with
    --moe-cache-auto under --gpu-memory-limit: tok/s, the measured miss rate and the PCIe bound (missed
    bytes per token / linear pinned H2D bandwidth of this run)."""
    from services.engine.config import EngineConfig
    from services.engine.models.registry import load_model
    from services.engine.runtime.kv_cache import ForwardBatch, KVCache

    prompt_len, warm, n = 32, args.decode_warmup, args.decode_tokens
    config = EngineConfig(model=args.decode, device=args.device, dtype=args.decode_dtype, moe_backend="offload",
                          moe_cache_auto=True, gpu_memory_limit=args.gpu_memory_limit, max_running_requests=1,
                          max_seq_len=prompt_len + warm + n + 1)
    t0 = time.perf_counter()
    lm = load_model(config)
    load_s = time.perf_counter() - t0
    device = lm.device
    kv = KVCache(lm.spec, 1, config.max_seq_len, device, lm.dtype)
    ids = torch.randint(0, lm.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).to(device)
    logits = lm.model(ids, torch.arange(prompt_len, device=device), ForwardBatch.single(0, 0, prompt_len), kv)
    token, pos = logits[0].argmax().view(1), prompt_len

    def step():
        nonlocal token, pos, logits
        logits = lm.model(token, torch.tensor([pos], device=device), ForwardBatch.single(0, pos, 1), kv)
        token, pos = logits[0].argmax().view(1), pos + 1

    for _ in tqdm(range(warm), desc="decode warm-up", unit="tok", leave=False):  # cache to steady state
        step()
    before = lm.backend.stats()["cache"]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in tqdm(range(n), desc="decode", unit="tok", leave=False):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    after = lm.backend.stats()["cache"]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    missed_bytes = (after["bytes_fetched"] - before["bytes_fetched"]) / n
    out = {"model": args.decode, "gpu_memory_limit": args.gpu_memory_limit, "slots": after["slots"],
           "share_of_experts": after["share_of_experts"], "load_s": load_s, "tokens": n, "tok_s": n / dt,
           "ms_per_token": dt / n * 1e3, "miss_rate": misses / max(1, hits + misses),
           "missed_MB_per_token": missed_bytes / 1e6}
    if pcie_GBps:
        out["pcie_bound_ms_per_token"] = missed_bytes / pcie_GBps / 1e6
        out["pcie_bound_tok_s"] = 1e3 / out["pcie_bound_ms_per_token"] if missed_bytes else float("inf")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench cache-copy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="qwen3-30b-a3b", help=f"comma list of {', '.join(PROFILES)}")
    parser.add_argument("--bs", default="1,2,4,8,16,32", help="batch sizes (tokens per decode step)")
    parser.add_argument("--miss-rate", default="0,0.25,0.5,1.0", help="shares of the active experts that miss")
    parser.add_argument("--slots", default="E,0.4*L*E", help="cache sizes, expressions in E and L")
    parser.add_argument("--modes", default="fused", help="copy modes: fused,per-bank")
    parser.add_argument("--repeat", type=int, default=25, help="timed repetitions (median)")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (smoke run)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    parser.add_argument("--decode", default=None, metavar="MODEL",
                        help="also time bs=1 decode of the offload backend on MODEL (e.g. synthetic:qwen3-30b-a3b)")
    parser.add_argument("--gpu-memory-limit", type=float, default=24.0, help="--decode: VRAM budget in GiB")
    parser.add_argument("--decode-tokens", type=int, default=64, help="--decode: timed tokens")
    parser.add_argument("--decode-warmup", type=int, default=32, help="--decode: tokens before timing")
    parser.add_argument("--decode-dtype", default="bfloat16", help="--decode: float32 or bfloat16")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu --profile tiny for a smoke run)")
    result = run(args) if args.profile else {"device": args.device, "repeat": args.repeat, "profiles": {}, "rows": []}
    print_table(result)
    if args.decode:
        lin = [p["linear_h2d_1GiB"].get("GBps") for p in result["profiles"].values() if p["linear_h2d_1GiB"]]
        if not lin and args.device == "cuda":
            lin = [linear_h2d(1 << 30, torch.device(args.device), Timer(torch.device(args.device)), args.repeat)["GBps"]]
        d = result["decode"] = decode_run(args, lin[0] if lin else None)
        line = (f"offload bs=1 decode on {d['model']} (limit {d['gpu_memory_limit']} GiB, {d['slots']} slots = "
                f"{d['share_of_experts']:.1%} of experts): {d['tok_s']:.2f} tok/s ({d['ms_per_token']:.1f} ms/token), "
                f"miss rate {d['miss_rate']:.1%}, {d['missed_MB_per_token']:.1f} MB missed per token")
        if "pcie_bound_ms_per_token" in d:
            line += f"; PCIe bound {d['pcie_bound_ms_per_token']:.1f} ms/token ({d['pcie_bound_tok_s']:.2f} tok/s)"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
