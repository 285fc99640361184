"""How hybrid chooses its split (the `cpu` and `hybrid` backends, moe/hybrid.py): which steps may split at
all, the bandwidth profile's prior, one cost model per bucket of tokens per step (split_buckets.py), the
fixed c_sync measured at start, and the holds the runner and `auto` put on the split (same_split,
reset_split). What feeds the cost models after each step is in hybrid_measure.py.

HybridSplitControl is a part of HybridBackend (its base class): it reads and sets the backend's own
state (buckets, handoff, executor, cache), kept in one object so the forward path and the split see the
same fractions."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from services.common.logging import get_logger
from services.engine.moe.backends import BackendContext
from services.engine.moe.peer_split import make_split_controller
from services.engine.moe.split import DEFAULT_FRACTION, SplitController
from services.engine.moe.split_buckets import next_pow2

log = get_logger("moe.hybrid")

# steps of up to this many tokens may split (the "prefill" bucket above the decode cap); longer prompt
# chunks take the offload path: at 256 tokens x top-8 over 128 experts each expert has ~16 tokens, the
# CPU's share is arithmetic, not a DRAM stream, and the handoff's pinned rows stay small (256 x D)
SPLIT_MAX_TOKENS = 256
# decode batches above this take the offload path too: the graph handoff's job word carries T in 10 bits
SPLIT_MAX_DECODE = 512


def split_max_tokens(tunable: bool, max_running_requests: int) -> int:
    """The largest step that splits: SPLIT_MAX_TOKENS with the automatic split; with a fixed one (cpu,
    --moe-hybrid-max-fetch N) the decode cap, so prompt chunks above it keep the offload path they had
    before splits reached them (only the tuner can tell whether splitting them pays)."""
    cap = next_pow2(max(1, min(max_running_requests, SPLIT_MAX_DECODE)))
    return max(SPLIT_MAX_TOKENS, cap) if tunable else cap


def profile_format(ctx: BackendContext) -> tuple[str, str | None]:
    """(key, fallback) of this model's expert format in a profile (services/common/profiles.format_key): the
    dtype name for unquantized experts, else the format's name with the model dtype's entry as fallback. A
    GGUF file's layers may differ in format (Q4_K_M: q4_K and q4_K+q6_K): the most common one's."""
    from collections import Counter

    from services.common.profiles import format_key

    dtype = str(ctx.dtype).removeprefix("torch.")
    formats = Counter(layer.format.value for layer in ctx.banks.layers)
    fmt = formats.most_common(1)[0][0] if formats else "unquantized"
    key = format_key(fmt, dtype)
    return key, (dtype if key != dtype else None)


def profile_prior(ctx: BackendContext) -> dict:
    """Controller prior from this GPU's bandwidth profile (concurrent rates, c_sync), or {} without one."""
    if ctx.device.type != "cuda":
        return {}
    try:
        from services.common.profiles import find_profile, normalize_uuid, resolve_format

        uuid = normalize_uuid(str(torch.cuda.get_device_properties(ctx.device).uuid))
        found = find_profile(uuid)
    except Exception as exc:  # noqa: BLE001 - a broken profile must not stop serving; say why
        log.warning("hybrid: no usable bandwidth profile (%s: %s); starting from f=%.2f", type(exc).__name__, exc,
                    DEFAULT_FRACTION)
        return {}
    if not found:
        log.info("hybrid: no bandwidth profile for this GPU; starting from f=%.2f and measuring", DEFAULT_FRACTION)
        return {}
    profile, path = found
    key, why = resolve_format(profile, *profile_format(ctx))
    if why:
        log.warning("hybrid: %s", why)
    conc = profile.concurrent.get(key) if key is not None else None
    if conc is None:
        return {"c_sync_s": profile.c_sync_s}
    log.info("hybrid: prior from %s (%s): concurrent pcie %.1f + cpu %.1f GB/s, c_sync %.1f us", path, key,
             conc.pcie_ov, conc.cpu_ov, profile.c_sync_s * 1e6)
    return {"prior_fraction": conc.pcie_ov / (conc.pcie_ov + conc.cpu_ov), "pcie_bps": conc.pcie_ov * 1e9,
            "cpu_bps": conc.cpu_ov * 1e9, "c_sync_s": profile.c_sync_s}


class HybridSplitControl:
    """Per-bucket cost models and c_sync: the split side of HybridBackend."""

    def _make_controller(self, bucket: str) -> SplitController:
        """A bucket's cost model. The prefill bucket starts at f = 1 (the offload path, as before splits
        reached prompt chunks) unless the split is fixed: its tuner then measures whether splitting pays."""
        prior = dict(self._prior)
        if bucket == "prefill" and self._tunable:
            prior["prior_fraction"] = 1.0
        controller = make_split_controller(self.cache, self.expert_bytes, **prior)  # 3 paths with a peer tier
        controller.c_sync_s = getattr(self, "c_sync_calibrated", controller.c_sync_s)
        return controller

    @property
    def controller(self) -> SplitController:
        """The cost model of the last observed step's bucket (the stats' headline)."""
        return self.buckets.states[self.buckets.last].controller

    def reset_split(self, prior: dict) -> None:
        """New priors for every bucket's cost model (a profile reload): tuners and pins dropped."""
        self._prior = {**prior, "prior_fraction": prior.get("prior_fraction")}
        for i, state in enumerate(self.buckets.states):
            state.controller, state.tuner, state.steps = self._make_controller(state.name), None, 0
            state.pinned = None
            self.buckets.write(i)

    @contextlib.contextmanager
    def same_split(self):
        """While held, every bucket computes every miss on the CPU (f = 0: nothing fetched, its word in the
        fraction array, which a captured graph reads too), so passes over the same inputs meet the same
        cache and split alike; the fractions come back after. For the runner's replay check: without it
        the eager pass finds the replay's fetches as hits and computes on the GPU what the replay computed
        on the CPU, and bf16 rounding on the two sides moves a sensitive model's logits far: synthetic
        gpt-oss-120b (36 layers) by 2-32 % of their largest value (CPU, docs/gpt-oss.md), qwen3 ~2 %."""
        with self.buckets.all_on_cpu():
            yield

    @property
    def settling(self) -> bool:
        """True while the split of the last observed step's bucket is still being searched."""
        return self.buckets.states[self.buckets.last].settling

    def _calibrate_c_sync(self, reps: int = 20) -> None:
        """The fixed per-layer cost of submit + sync: round trips of an empty CPU job (all ids -1). Graph
        mode times them where decode runs them, inside a captured graph (eager launches and a host sync
        per round trip would say ~220 us instead of ~25 and push the split toward fetching)."""
        D = self.executor.banks.layers[0].tensors["down"].shape[1]
        dtype = self.dtype  # the activations' (an fp8 bank's dtype is not one)
        hidden = torch.zeros(1, D, dtype=dtype, device=self.device)
        A = self.handoff.A if self.handoff is not None else 1
        ids = torch.full((1, A), -1, dtype=torch.int64, device=self.device)
        w = torch.zeros(1, A, device=self.device)
        if self.graph_mode:
            self.c_sync_calibrated = self._graph_round_trip(hidden, ids, w, reps)
        else:
            times = []
            for _ in range(reps):
                if self.handoff is not None:
                    torch.cuda.synchronize(self.device)
                    t0 = time.perf_counter()
                    self.handoff.submit(0, hidden, ids, w)
                    self.handoff.sync()
                    torch.cuda.synchronize(self.device)
                else:
                    t0 = time.perf_counter()
                    self.executor.forward(0, hidden, ids, w)
                times.append(time.perf_counter() - t0)
            self.c_sync_calibrated = statistics.median(times)
        for state in self.buckets.states:
            state.controller.c_sync_s = self.c_sync_calibrated
        self._routes_at_start = self.handoff.poll_stats()["routes"] if self.graph_mode else 0

    def _graph_round_trip(self, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, reps: int) -> float:
        """Seconds per handoff of ``reps`` empty handoffs captured back to back in one CUDA graph (best of 5
        replays; graph launch overhead shared by all of them)."""
        def body() -> None:
            for _ in range(reps):
                self.handoff.submit(0, hidden, ids, w)
                self.handoff.sync_add(0, hidden)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile the Triton kernels outside the capture
            body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        del graph
        return best / reps
