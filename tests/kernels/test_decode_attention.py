"""kernels/decode_attention against its torch reference (write through the block table, gather each row's
keys, SDPA): a paged cache whose blocks are a random permutation of a pool shared by the rows (BS 16 and 4),
rows at position 0, at block boundaries and past several key tiles, GQA folds G = 1, 2, 4, 8, Dh 64 and
128, sliding windows, gpt-oss sinks, one split and several; the new K/V must land at its paged place and
nothing else in the cache may change."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention, decode_attention_ref
from tests.kernels.conftest import kernel_device

NEVER = 1 << 30  # block-table entries past a row's used blocks: following one reads far out of bounds
POSITIONS = [0, 15, 16, 130, 199]  # first token · last of a 16-block · first of the next · 3 and 4 tiles in


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _case(H, K, Dh, positions, *, BS, W, dtype, seed, spare_rows=2):
    """q/k/v (strided views of one projection, as the model's) and a paged cache: the slots of the B rows
    plus ``spare_rows`` others (their blocks must stay untouched) take blocks from one shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    B, S = len(positions), len(positions) + spare_rows
    qkv = torch.randn(B, (H + 2 * K) * Dh, generator=g).to(dtype)
    q = qkv[:, :H * Dh].view(B, H, Dh)
    k = qkv[:, H * Dh:(H + K) * Dh].view(B, K, Dh)
    v = qkv[:, (H + K) * Dh:].view(B, K, Dh)
    slots = torch.randperm(S, generator=g)[:B]
    used = torch.randint(1, 4, (S,), generator=g)  # spare rows hold a few blocks too
    used[slots] = torch.tensor(positions) // BS + 1
    pool = torch.randperm(int(used.sum()) + 3, generator=g)  # 3 free blocks
    table = torch.full((S, -(-W // BS)), NEVER, dtype=torch.int32)
    for s, start in enumerate(torch.cumsum(used, 0) - used):
        table[s, :used[s]] = pool[start:start + used[s]]
    k_cache = torch.randn(len(pool), BS, K, Dh, generator=g).to(dtype)
    v_cache = torch.randn(len(pool), BS, K, Dh, generator=g).to(dtype)
    return [t.to(dev) for t in (q, k, v, k_cache, v_cache, table, slots, torch.tensor(positions))]


def _expected_caches(k, v, k_cache, v_cache, table, slots, positions):
    """The caches as they must be after the call: only [table[slot, p // BS], p % BS] holds the new k/v."""
    BS = k_cache.shape[1]
    kc, vc = k_cache.clone(), v_cache.clone()
    for b, (s, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        kc[table[s, p // BS], p % BS] = k[b]
        vc[table[s, p // BS], p % BS] = v[b]
    return kc, vc


def _check(H, K, Dh, positions, *, BS, W, window, dtype, seed, splits=None, sinks=None):
    """Kernel vs reference on one case; both must leave exactly the expected caches. -> the kernel's output."""
    q, k, v, kc, vc, table, slots, pos = _case(H, K, Dh, positions, BS=BS, W=W, dtype=dtype, seed=seed)
    kc_want, vc_want = _expected_caches(k, v, kc, vc, table, slots, pos)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = decode_attention(q, k, v, kc, vc, table, slots, pos, window, W, sinks=sinks, splits=splits)
    ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, table, slots, pos, window, W, sinks=sinks)
    assert got.shape == (len(positions), H, Dh) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
    for cache, want, ref_cache in ((kc, kc_want, kc_ref), (vc, vc_want, vc_ref)):
        assert torch.equal(cache, want) and torch.equal(ref_cache, want)
    return got


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("BS", [16, 4])
@pytest.mark.parametrize("H, K, Dh, window", [(4, 4, 64, 0), (4, 2, 128, 37), (8, 2, 64, 0), (8, 1, 64, 70)])
def test_matches_reference(H, K, Dh, window, BS, splits):
    """G = 1, 2, 4, 8; one split (every tile in one program) and 3 (interleaved, some with no tile)."""
    _check(H, K, Dh, POSITIONS, BS=BS, W=256, window=window, dtype=torch.float32, seed=H * K + Dh + BS, splits=splits)


@pytest.mark.parametrize("H, K, Dh, window, splits", [(8, 2, 64, 0, None), (4, 1, 128, 37, 2)])
def test_bf16_matches_reference(H, K, Dh, window, splits):
    _check(H, K, Dh, POSITIONS, BS=16, W=256, window=window, dtype=torch.bfloat16, seed=5, splits=splits)


def test_window_shorter_than_one_tile_and_wider_than_the_context():
    """A window of 5 keys (its start inside a tile) and one longer than every position (= no window)."""
    short = _check(8, 2, 64, POSITIONS, BS=4, W=256, window=5, dtype=torch.float32, seed=3, splits=2)
    wide = _check(8, 2, 64, POSITIONS, BS=4, W=256, window=1000, dtype=torch.float32, seed=3, splits=2)
    full = _check(8, 2, 64, POSITIONS, BS=4, W=256, window=0, dtype=torch.float32, seed=3, splits=2)
    torch.testing.assert_close(wide, full, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(short[1:], full[1:], atol=1e-3)  # the window changes every row but the first


def test_short_context_far_below_W():
    """W = 40960 (Qwen3's trained context) with positions < 100: the default split count comes from W's
    static sizes, the work from each row's own keys; the result equals a W = 128 launch's."""
    positions = [0, 5, 63, 64, 99]
    long_w = _check(8, 2, 64, positions, BS=16, W=40960, window=0, dtype=torch.float32, seed=9)
    short_w = _check(8, 2, 64, positions, BS=16, W=128, window=0, dtype=torch.float32, seed=9)
    torch.testing.assert_close(long_w, short_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, splits", [(0, 1), (0, 4), (37, 3)])
def test_sinks_match_reference(window, splits, dtype):
    """gpt-oss: a sink logit per query head (some far above the scores, so the sink takes most of the
    softmax, some far below), sliding windows, several splits, a first token."""
    sinks = torch.tensor([0.0, 1.5, -2.0, 8.0, -30.0, 3.0, 0.5, 20.0]).to(dtype).to(kernel_device())
    got = _check(8, 2, 64, POSITIONS, BS=16, W=256, window=window, dtype=dtype, seed=13, splits=splits, sinks=sinks)
    without = _check(8, 2, 64, POSITIONS, BS=16, W=256, window=window, dtype=dtype, seed=13, splits=splits)
    assert not torch.allclose(got.float(), without.float(), atol=1e-2)  # the sinks change the output


def test_sink_reference_is_the_extra_key_of_the_model():
    """The reference's explicit softmax equals the model's torch path (one extra key, K = V = 0, bias = sink)
    over keys gathered here position by position through the block table."""
    H, K, Dh, window = 4, 2, 64, 5
    positions = [3, 9, 17]
    q, k, v, kc, vc, table, slots, pos = _case(H, K, Dh, positions, BS=4, W=32, dtype=torch.float32, seed=17)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(0)).to(q.device) * 3
    ref = decode_attention_ref(q, k, v, kc.clone(), vc.clone(), table, slots, pos, window, 32, sinks=sinks)
    kc, vc = _expected_caches(k, v, kc, vc, table, slots, pos)
    L, G, B = max(positions) + 1, H // K, len(positions)
    ks, vs = kc.new_zeros(B, K, L + 1, Dh), vc.new_zeros(B, K, L + 1, Dh)  # the last key: the sink's zeros
    bias = torch.full((B, K, G, L + 1), float("-inf"), device=q.device)
    for b, (s, p) in enumerate(zip(slots.tolist(), positions)):
        for j in range(max(0, p - window + 1), p + 1):
            ks[b, :, j], vs[b, :, j] = kc[table[s, j // 4], j % 4], vc[table[s, j // 4], j % 4]
            bias[b, :, :, j] = 0.0
    bias[..., L] = sinks.view(1, K, G)
    o = torch.nn.functional.scaled_dot_product_attention(q.reshape(B, K, G, Dh), ks, vs, attn_mask=bias)
    torch.testing.assert_close(ref, o.reshape(B, H, Dh), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(sinks=torch.zeros(2)), r"sinks \(2,\) do not fit \[H\]"),
    (lambda a: a.update(table=a["table"].long()), r"must be int32"),
    (lambda a: a.update(W=257), r"address W = 257"),
    (lambda a: a.update(splits=100), r"splits = 100 outside"),
])
def test_bad_arguments_are_refused(change, match):
    q, k, v, kc, vc, table, slots, pos = _case(4, 2, 64, [3], BS=16, W=256, dtype=torch.float32, seed=0)
    args = dict(table=table, W=256, sinks=None, splits=None)
    change(args)
    sinks = args["sinks"].to(q.device) if args["sinks"] is not None else None
    with pytest.raises(ValueError, match=match):
        decode_attention(q, k, v, kc, vc, args["table"], slots, pos, 0, args["W"], sinks=sinks, splits=args["splits"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_realistic_bf16_cuda():
    """Qwen3-30B-A3B's geometry at 16 streams (32 query heads, 4 kv heads, Dh 128), contexts up to ~8k in
    a pool of 16-token blocks, W = 40960, default splits."""
    g = torch.Generator().manual_seed(21)
    positions = torch.randint(0, 8192, (16,), generator=g).tolist()
    positions[:3] = [0, 17, 8191]
    _check(32, 4, 128, positions, BS=16, W=40960, window=0, dtype=torch.bfloat16, seed=21)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 128])
def test_cuda_graph_replay_at_new_positions(window):
    """gpt-oss-120b's attention geometry (64 query heads, 8 kv heads, Dh 64, sinks), bf16, W = 131072:
    captured once, replayed with new positions (longer and shorter) in the same blocks."""
    H, K, Dh, W = 64, 8, 64, 131072
    q, k, v, kc, vc, table, slots, pos = _case(H, K, Dh, [700, 3000], BS=16, W=W, dtype=torch.bfloat16, seed=19)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    decode_attention(q, k, v, kc, vc, table, slots, pos, window, W, sinks=sinks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, kc, vc, table, slots, pos, window, W, sinks=sinks)
    for new in ([3, 2900], [701, 64]):
        pos.copy_(torch.tensor(new, device="cuda"))
        kc_ref, vc_ref = kc.clone(), vc.clone()
        graph.replay()
        ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, table, slots, pos, window, W, sinks=sinks)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
