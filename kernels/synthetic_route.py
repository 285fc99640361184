"""synthetic_route: the experts a token uses under a routing preset (services/engine/moe/routing_presets.py),
in ONE launch per MoE layer, inside the decode graphs.

Dimension legend: T tokens · E experts · A experts per token (top-k) · S request slots.

The process (per layer; stateless, so a prompt chunk, a decode row, a recomputed preemption and a CUDA-graph
replay all give a token the same experts): a token has A *lanes*. At each position a lane either keeps the
expert it held at the previous position (probability ``stay``) or draws a fresh one from the layer's popularity
(``cdf`` over ``perm``: rank r is expert perm[r]). A lane's expert at position t is therefore the draw made at
its last fresh position u <= t, found by walking back from t: position 0 and every LANE_SPAN-th position (one
phase per lane) are always fresh, which bounds the walk. Every random number is a hash of (layer key, the
request's salt, position, lane): no generator state to keep, save or capture. A lane whose expert another lane
of the token already holds draws again (REDRAWS times), then takes the next expert id that is free: the A
experts of a token are distinct. The weights are the router's softmax over the chosen experts (renormalized
when the model renormalizes), so the router still runs and its cost stays real.

The reference is ``synthetic_route_ref`` (torch, the CPU path); tests/kernels/test_synthetic_route.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LANE_SPAN = 64  # a lane draws afresh at least every LANE_SPAN positions: the walk back is at most this long
REDRAWS = 3  # fresh draws tried before a colliding lane takes the next free expert id
_M32 = 0xFFFFFFFF


# -- the hash, in int64 holding uint32 values (the same integer maths in torch and Triton) --------------------

def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply, two rounds) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash2(a: torch.Tensor, b) -> torch.Tensor:
    return mix32((mix32(a) + b) & _M32)


def uniform(h: torch.Tensor) -> torch.Tensor:
    """[0, 1) float32 from a hash: its top 24 bits, exact in float32."""
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def layer_key(seed: int, layer: int) -> int:
    """The per-layer key every hash of that layer starts from."""
    return int(hash2(torch.tensor(seed & _M32), (layer * 0x9E3779B9) & _M32))


def synthetic_route_ref(router_logits: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                        salt: torch.Tensor, key: int, stay: float, cdf: torch.Tensor, perm: torch.Tensor,
                        top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] · positions, token_slots [T] int64 · salt [S] int64 (per request slot) · cdf [E] fp32
    (cumulative popularity by rank, last 1) · perm [E] int64 (expert of each rank) -> (weights [T, A] fp32,
    ids [T, A] int64), the module docstring's process."""
    T, E = router_logits.shape
    dev = router_logits.device
    lanes = torch.arange(top_k, device=dev)  # [A]
    tok_key = hash2(torch.full_like(positions, key) ^ salt[token_slots], 0)  # [T]
    phase = (lanes * LANE_SPAN) // top_k  # [A] each lane's forced-fresh phase
    last = torch.full((T, top_k), -1, dtype=torch.long, device=dev)  # [T, A] the lane's last fresh position
    for back in range(LANE_SPAN):
        u = (positions - back)[:, None]  # [T, 1]
        fresh = ((u == 0) | ((u + phase) % LANE_SPAN == 0)
                 | (uniform(hash2(hash2(tok_key[:, None], u.clamp(min=0)), lanes)) >= stay))
        last = torch.where((last < 0) & fresh & (u >= 0), u.expand(-1, top_k), last)
        if bool((last >= 0).all()):
            break
    lane_key = hash2(tok_key[:, None], last)  # [T, A]

    def draw(attempt: int) -> torch.Tensor:  # [T, A] experts drawn by popularity
        rank = torch.searchsorted(cdf, uniform(hash2(lane_key, top_k * (attempt + 1) + lanes)), right=True)
        return perm[rank.clamp(max=E - 1)]

    chosen = torch.full((T, top_k), -1, dtype=torch.long, device=dev)
    redraws = [draw(k) for k in range(REDRAWS + 1)]
    for a in range(top_k):
        cand = redraws[0][:, a]
        for k in range(1, REDRAWS + 1):
            cand = torch.where((chosen == cand[:, None]).any(1), redraws[k][:, a], cand)
        for _ in range(top_k):
            cand = torch.where((chosen == cand[:, None]).any(1), (cand + 1) % E, cand)
        chosen[:, a] = cand
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights = probs.gather(1, chosen)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


# -- the kernel: one program per token ------------------------------------------------------------------------

@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _hash2(a, b):
    return _mix32((_mix32(a) + b) & 0xFFFFFFFF)


@triton.jit
def _uniform(h):
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _draw(lane_key, salt_term, cdf, offs_e, mask_e, perm_ptr, E):
    """The expert a lane draws: rank = how many cdf entries are <= the uniform, expert = perm[rank]."""
    u = _uniform(_hash2(lane_key, salt_term))
    rank = tl.sum(tl.where(mask_e & (cdf <= u), 1, 0), axis=0)
    return tl.load(perm_ptr + tl.minimum(rank, E - 1))


@triton.jit
def _synthetic_route_kernel(
    logits_ptr, pos_ptr, slot_ptr, salt_ptr, cdf_ptr, perm_ptr, w_ptr, ids_ptr,
    key, stay, E, A, stride_l, stride_w, stride_ids,
    RENORMALIZE: tl.constexpr, SPAN: tl.constexpr, N_REDRAWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    salt = tl.load(salt_ptr + tl.load(slot_ptr + t))
    tok_key = _hash2(key ^ salt, 0)
    offs_a = tl.arange(0, BLOCK_A)
    offs_e = tl.arange(0, BLOCK_E)
    mask_a = offs_a < A
    mask_e = offs_e < E
    phase = (offs_a * SPAN) // A
    last = tl.where(mask_a, -1, 0).to(tl.int64)  # padding lanes count as found
    back = 0
    while tl.min(last, axis=0) < 0:  # walk back to each lane's last fresh position (ends within SPAN steps)
        u = pos - back
        fresh = (u == 0) | ((u + phase) % SPAN == 0) | (_uniform(_hash2(_hash2(tok_key, tl.maximum(u, 0)), offs_a)) >= stay)
        last = tl.where((last < 0) & fresh & (u >= 0), u, last)
        back += 1
    lane_key = _hash2(tok_key, last)  # [BLOCK_A]
    cdf = tl.load(cdf_ptr + offs_e, mask=mask_e, other=2.0)
    chosen = tl.full([BLOCK_A], -1, dtype=tl.int64)
    for a in tl.static_range(BLOCK_A):
        if a < A:
            k_a = tl.sum(tl.where(offs_a == a, lane_key, 0), axis=0)
            cand = _draw(k_a, A + a, cdf, offs_e, mask_e, perm_ptr, E)
            taken = tl.sum(tl.where(chosen == cand, 1, 0), axis=0) > 0
            k = 1
            while taken & (k <= N_REDRAWS):  # draw again only on a collision (rare): the usual lane costs one draw
                cand = _draw(k_a, A * (k + 1) + a, cdf, offs_e, mask_e, perm_ptr, E)
                taken = tl.sum(tl.where(chosen == cand, 1, 0), axis=0) > 0
                k += 1
            while taken:  # then the next free id (ends within A steps)
                cand = (cand + 1) % E
                taken = tl.sum(tl.where(chosen == cand, 1, 0), axis=0) > 0
            chosen = tl.where(offs_a == a, cand, chosen)
    x = tl.load(logits_ptr + t * stride_l + offs_e, mask=mask_e, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    denom = tl.sum(tl.exp(x - m), axis=0)
    picked = tl.load(logits_ptr + t * stride_l + tl.maximum(chosen, 0), mask=mask_a, other=float("-inf")).to(tl.float32)
    w = tl.exp(picked - m) / denom  # lanes >= A: exp(-inf) = 0
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    tl.store(w_ptr + t * stride_w + offs_a, w, mask=mask_a)
    tl.store(ids_ptr + t * stride_ids + offs_a, chosen, mask=mask_a)


def synthetic_route(router_logits: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                    salt: torch.Tensor, key: int, stay: float, cdf: torch.Tensor, perm: torch.Tensor,
                    top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``synthetic_route_ref``, one launch (graph-capturable: no host sync)."""
    T, E = router_logits.shape
    if router_logits.stride(1) != 1 or not 0 < top_k <= E:
        raise ValueError(f"synthetic_route: router_logits {tuple(router_logits.shape)} needs a contiguous last dim "
                         f"and 0 < top_k={top_k} <= E")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T:
        _synthetic_route_kernel[(T,)](
            router_logits, positions, token_slots, salt, cdf, perm, weights, ids,
            key, stay, E, top_k, router_logits.stride(0), weights.stride(0), ids.stride(0),
            RENORMALIZE=renormalize, SPAN=LANE_SPAN, N_REDRAWS=REDRAWS,
            BLOCK_E=triton.next_power_of_2(E), BLOCK_A=triton.next_power_of_2(top_k),
            num_warps=1,  # one warp: every reduction here stays in registers (across warps each is a barrier)
        )
    return weights, ids
