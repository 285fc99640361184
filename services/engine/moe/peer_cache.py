"""The peer tier of the expert cache: slots on other GPUs (docs/multi-gpu.md).

Legend: L MoE layers · E experts per layer · S home slots · K peer devices · P slots per peer device ·
G = K*P peer slots · NB banks per expert.

One engine computes on its home device; ``--moe-peer-devices cuda:1,...`` gives it a second tier of expert
slots in the VRAM of other GPUs (``--moe-peer-memory`` GiB each). A home miss is then copied from a peer
slot when a peer holds the expert (P2P: NVLink or PCIe peer-to-peer, device to device) and from the pinned
host banks otherwise, in the same fused launch (kernels/peer_copy.py); in `hybrid` the CPU executor still
takes its share of the misses (services/engine/moe/peer_split.py sizes the three paths).

Placement: static, refreshed. The peer slots start with the experts in the order (expert 0 of every
layer, expert 1 of every layer, ...), every layer an equal share; after 16, 32, 64, ... decode steps, then
every ``REFRESH_STEPS``, they are re-chosen as the G most used experts (the cache's lfu counts) that the home
slots do not hold: the ones the next misses are likeliest to ask for. A tier with G >= L*E holds every
expert and never moves. A refresh waits for the devices (one sync), copies the newly placed experts from
the host banks and rewrites the table; the decode graphs read the table and the peer slots in place.

Simulated peers (tests, one-GPU hosts): a peer may be the home device itself (``cuda:0`` beside a home
``cuda:0``, or ``cpu`` for a CPU engine): its slots are a second pool on that device and a "P2P" copy is
a device-to-device copy between the pools. The data path is the same as with a real second GPU.
"""

from __future__ import annotations

import ctypes
import time

import torch

from services.common.logging import get_logger
from services.engine.moe.sizing import GiB, HEADROOM_FRACTION, HEADROOM_MIN_BYTES, fmt_bytes

log = get_logger("moe.peer_cache")

# Placement refreshes after 16, 32, 64, ... decode steps (the use counts settle fast at first), then every
# REFRESH_STEPS: each is one sync and the copies of the experts placed anew (few once the counts settle)
FIRST_REFRESH = 16
REFRESH_STEPS = 1024
PROBE_BYTES = 64 << 20  # the startup P2P probe's copy: large enough to reach the link's rate (NVLink ~ms)
_PEER_ACCESS_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


def parse_peer_devices(spec: str) -> list[torch.device]:
    """'cuda:1,cuda:2' -> devices (order kept, duplicates refused)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    devices = [torch.device(n) for n in names]
    if len(set(names)) != len(names):
        raise ValueError(f"--moe-peer-devices {spec!r}: a device is named twice")
    return devices


def enable_peer_access(home: int, peer: int) -> None:
    """Let kernels on GPU ``home`` read GPU ``peer``'s memory (cuCtxEnablePeerAccess on home's primary
    context); the fused copy reads the peer slots directly. ValueError when the pair cannot do P2P."""
    if not torch.cuda.can_device_access_peer(home, peer):
        raise ValueError(f"--moe-peer-devices: cuda:{home} cannot access cuda:{peer} peer to peer (no NVLink or PCIe "
                         "P2P between them; `nvidia-smi topo -m` shows the links)")
    a, b = torch.zeros(1, device=f"cuda:{home}"), torch.zeros(1, device=f"cuda:{peer}")
    a.copy_(b), b.copy_(a)  # both primary contexts exist; torch enables peer access its own way first
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for rc in (lib.cuDeviceGet(ctypes.byref(dev), peer), lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)):
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc} while looking up cuda:{peer}'s context")
    with torch.cuda.device(home):
        torch.cuda.synchronize(home)  # a runtime call: home's primary context is current on this thread
        rc = lib.cuCtxEnablePeerAccess(ctx, 0)
    if rc not in (0, _PEER_ACCESS_ALREADY_ENABLED):
        raise RuntimeError(f"cuCtxEnablePeerAccess(cuda:{home} -> cuda:{peer}) failed with CUDA driver error {rc}")


def measure_copy_gbps(src: torch.device, dst: torch.device, nbytes: int = PROBE_BYTES, reps: int = 5) -> float:
    """GB/s of one linear ``nbytes`` copy src -> dst (best of ``reps``; device to device: cudaMemcpyPeer
    between GPUs, a copy within one). The profiler's P2P probe and the engine's startup probe."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    cuda = [d for d in (src, dst) if d.type == "cuda"]
    sync = (lambda: [torch.cuda.synchronize(d) for d in cuda]) if cuda else (lambda: None)
    b.copy_(a)  # warm-up: peer access, allocator, first-touch
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class PeerTier:
    """G slots on K peer devices, their table and counters; the cache copies its misses through it."""

    def __init__(self, cache, devices: list[torch.device], slots_per_device: int, p2p_gbps: dict[str, float]):
        """cache: the home ExpertCache · devices: the K peers · slots_per_device: P · p2p_gbps: per peer
        device name, its measured rate into the home device (GB/s)."""
        from kernels.gather_copy import CopyPlan

        if slots_per_device <= 0:
            raise ValueError(f"peer tier: {slots_per_device} slots per device")
        self.cache, self.devices, self.P = cache, devices, slots_per_device
        self.L, self.E = cache.num_layers, cache.num_experts
        host0 = cache.plan.host_layers[0]
        self.banks = [{name: torch.zeros((self.P, *t.shape[1:]), dtype=t.dtype, device=dev) for name, t in host0.items()}
                      for dev in devices]  # per peer {bank: [P, ...]}
        self.plan = CopyPlan(self.banks, cache.slot_banks)  # one "layer" of P "experts" per peer
        home = cache.device
        self.peer_slot_of_id = torch.full((self.L * self.E,), -1, dtype=torch.int32, device=home)  # [L*E]
        self.peer_fetched = torch.zeros(self.L, dtype=torch.int64, device=home)  # [L]
        self.placed = [-1] * self.num_slots  # host mirror: flat id held by each peer slot
        self.p2p_gbps = p2p_gbps
        self.steps = self.refreshes = self.moved = 0
        self._next_refresh = FIRST_REFRESH
        # share of the fetched misses a peer served: first the share of the experts outside the home slots
        # that the tier holds (uniform routing), then counted between refreshes (the hybrid's cost model)
        self.peer_share = min(1.0, self.num_slots / max(1, self.L * self.E - cache.num_slots))
        self._counted = (0, 0)  # (peer_fetched, fetched) at the last refresh
        # every layer an equal share to start with: (l0 e0, l1 e0, ..., l0 e1, ...)
        self.place([l * self.E + e for e in range(self.E) for l in range(self.L)][: self.num_slots])

    @property
    def num_slots(self) -> int:
        return len(self.devices) * self.P

    @property
    def holds_everything(self) -> bool:
        return self.num_slots >= self.L * self.E

    def copy_missing(self, state, max_jobs: int | None, use_kernel: bool) -> None:
        """The jobs recorded in ``state`` into the home slots: from a peer slot or the host banks."""
        from kernels.peer_copy import copy_tiered_fused, copy_tiered_reference

        args = (self.cache.plan, self.plan, state.job_src, state.job_dst, state.job_count, self.peer_slot_of_id,
                self.peer_fetched)
        if use_kernel:
            copy_tiered_fused(*args, max_jobs=max_jobs)
        else:
            copy_tiered_reference(*args)

    # ---- placement ---------------------------------------------------------------------------------

    def _sync(self) -> None:
        for dev in {self.cache.device, *self.devices}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def place(self, flat_ids: list[int]) -> int:
        """Make the peer tier hold ``flat_ids`` (at most G): experts already placed keep their slots, the
        others take the slots of experts no longer wanted. Returns how many experts were copied."""
        want = list(dict.fromkeys(flat_ids))[: self.num_slots]
        keep = set(want) & set(self.placed)
        free = [g for g, f in enumerate(self.placed) if f not in keep]
        new = [f for f in want if f not in keep]
        self._sync()  # no replay still reads a slot about to change
        gone = [self.placed[g] for g in free[: len(new)] if self.placed[g] >= 0]
        if gone:
            self.peer_slot_of_id[torch.tensor(gone, dtype=torch.long, device=self.cache.device)] = -1
        host = self.cache.plan.host_layers
        for g, flat in zip(free, new):
            k, p = divmod(g, self.P)
            for name, bank in self.banks[k].items():
                bank[p].copy_(host[flat // self.E][name][flat % self.E], non_blocking=True)
            self.placed[g] = flat
        if new:
            slots = torch.tensor(free[: len(new)], dtype=torch.int32)
            self.peer_slot_of_id[torch.tensor(new, dtype=torch.long).to(self.cache.device)] = slots.to(self.cache.device)
        self._sync()
        self.moved += len(new)
        return len(new)

    def refresh(self) -> int:
        """Re-place: the G most used experts the home slots do not hold (currently placed ones win ties)."""
        state = self.cache.state
        counted = (int(self.peer_fetched.sum()), int(state.fetched.sum()))
        if counted[1] > self._counted[1]:
            self.peer_share = min(1.0, (counted[0] - self._counted[0]) / (counted[1] - self._counted[1]))
        self._counted = counted
        score = state.uses.double().cpu() * 2  # [L*E]
        placed = torch.tensor([f for f in self.placed if f >= 0], dtype=torch.long)
        score[placed] += 1
        score[(state.slot_of_id >= 0).cpu()] = -1  # at home: a peer copy of it would never be read
        moved = self.place(torch.topk(score, self.num_slots).indices.tolist())
        self.refreshes += 1
        return moved

    def observe_step(self) -> None:
        """One decode step done (model thread, between steps): refresh after 16, 32, ... steps, then every
        REFRESH_STEPS."""
        self.steps += 1
        if not self.holds_everything and self.steps >= self._next_refresh:
            self._next_refresh = min(2 * self._next_refresh, self._next_refresh + REFRESH_STEPS)
            moved = self.refresh()
            log.debug("peer tier refresh %d: %d experts placed anew", self.refreshes, moved)

    def stats(self) -> dict:
        per_layer = self.peer_fetched.tolist()
        return {"devices": [str(d) for d in self.devices], "slots_per_device": self.P, "peer_slots": self.num_slots,
                "peer_slot_bytes": self.num_slots * self.cache.expert_nbytes, "held": sum(f >= 0 for f in self.placed),
                "peer_share": self.peer_share,
                "peer_fetched": sum(per_layer), "per_layer_peer_fetched": per_layer, "p2p_gbps": self.p2p_gbps,
                "refreshes": self.refreshes, "experts_moved": self.moved}


def peer_slots(config, device: torch.device, home: torch.device, expert_bytes: int) -> tuple[int, str]:
    """(slots, how) for one peer: --moe-peer-memory GiB, else the peer's free VRAM less headroom (a peer on
    a CPU engine: every expert); a simulated peer on the home GPU needs --moe-peer-memory."""
    if config.moe_peer_memory is not None:
        budget = int(config.moe_peer_memory * GiB)
        return budget // expert_bytes, f"--moe-peer-memory {config.moe_peer_memory}"
    if device.type == "cpu":
        return 1 << 62, "a CPU peer: every expert"
    if device == home:
        raise ValueError(f"--moe-peer-devices {device}: a peer on the home device shares its memory; give "
                         "--moe-peer-memory GiB")
    free, _ = torch.cuda.mem_get_info(device)
    # blocks torch caches there count as used by the driver but are ours to reuse (`auto` rebuilding its
    # backend frees the old tier into that cache)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    budget = free - max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * free))
    return max(0, budget) // expert_bytes, f"free {fmt_bytes(free)} less headroom"


def make_peer_tier(ctx, cache) -> PeerTier | None:
    """The peer tier of ``--moe-peer-devices`` for ``cache`` (None when the flag is empty)."""
    spec = ctx.config.moe_peer_devices
    if not spec:
        return None
    devices = parse_peer_devices(spec)
    home = cache.device
    if home.type == "cuda" and home.index is None:
        home = torch.device("cuda", torch.cuda.current_device())
    for dev in devices:
        if dev.type != home.type:
            raise ValueError(f"--moe-peer-devices {spec!r}: a {home.type} engine takes {home.type} peers, got {dev}")
        if dev.type == "cuda":
            if dev.index is None or dev.index >= torch.cuda.device_count():
                raise ValueError(f"--moe-peer-devices {spec!r}: {dev} is not a visible GPU (give cuda:N, N < "
                                 f"{torch.cuda.device_count()})")
            if dev.index != home.index:
                enable_peer_access(home.index, dev.index)
    L, E = cache.num_layers, cache.num_experts
    sizes = [peer_slots(ctx.config, dev, home, cache.expert_nbytes) for dev in devices]
    per_device = min(min(s for s, _ in sizes), -(-L * E // len(devices)))  # equal pools; no more than all experts
    if per_device <= 0:
        raise ValueError(f"--moe-peer-devices {spec!r}: no room for one expert ({fmt_bytes(cache.expert_nbytes)}) on a "
                         f"peer ({'; '.join(how for _, how in sizes)})")
    p2p = {str(dev): peer_rate(dev, home) for dev in devices}
    tier = PeerTier(cache, devices, per_device, p2p)
    log.info("peer tier: %d slots on each of %s = %s, %.0f%% of all experts (%s); P2P into %s: %s GB/s", per_device,
             ", ".join(map(str, devices)), fmt_bytes(tier.num_slots * cache.expert_nbytes),
             100 * min(1.0, tier.num_slots / (L * E)), sizes[0][1], home,
             ", ".join(f"{d} {r:.1f}" for d, r in p2p.items()))
    return tier


def peer_rate(peer: torch.device, home: torch.device) -> float:
    """GB/s from ``peer`` into ``home``: the profile's P2P link when `tandem bench bw` measured it, else
    measured now (one 64 MiB copy, best of 5)."""
    if peer.type == "cuda" and peer != home:
        try:
            from services.common.profiles import find_profile, normalize_uuid

            uuid = lambda d: normalize_uuid(str(torch.cuda.get_device_properties(d).uuid))  # noqa: E731
            found = find_profile(uuid(home))
            links = {(x.src, x.dst): x.gbps for x in found[0].p2p} if found else {}
            if (uuid(peer), uuid(home)) in links:
                return links[(uuid(peer), uuid(home))]
        except Exception as exc:  # noqa: BLE001 - a broken profile must not stop serving; measure instead
            log.warning("peer tier: no usable P2P rate in the profile (%s: %s); measuring", type(exc).__name__, exc)
    return measure_copy_gbps(peer, home, PROBE_BYTES if home.type == "cuda" else 4 << 20)  # CPU: a memcpy's rate
