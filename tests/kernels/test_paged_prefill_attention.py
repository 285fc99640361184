"""kernels/paged_prefill_attention: the Triton kernel against its torch reference, and the reference against an
independent dense computation (a full fp32 softmax over [H, n, end] scores of the sequence's own K/V, masked
from positions). The caches are a shared pool whose blocks are handed out in a random order (a sequence's
blocks are not contiguous, sequences interleave), every entry nobody wrote is NaN (block 0, which the
table's unused entries point at, the tail of each last block): reading a key the masks exclude, or a table
entry past a slot's blocks, poisons the output. Block sizes 16, 4 and 6 (4 divides the 16-key tiles, 6 does not).
Then the reference's memory bound on a 20k-key context, and on CUDA a bf16 case at a real size."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_prefill_attention as ppa
from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref, write_kv
from tests.kernels.conftest import kernel_device


def _case(seqs, H, K, Dh, BS, dtype=torch.float32, seed=0, device=None):
    """seqs [(start, n)] -> (args of the attention functions, per-sequence K and V [start + n, K, Dh] as
    written, q). The prefix positions are stored directly, the new tokens through ``write_kv``."""
    g = torch.Generator().manual_seed(seed)
    dev = device or kernel_device()
    N = len(seqs)
    blocks = [-(-(s + n) // BS) for s, n in seqs]
    NB, S, MB = sum(blocks) + 3, N + 2, max(blocks) + 2
    order = (torch.randperm(NB - 1, generator=g) + 1).tolist()  # block 0 stays unused (NaN), as the table's fill
    k_cache = torch.full((NB, BS, K, Dh), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(S, MB, dtype=torch.int32)
    slots = torch.randperm(S, generator=g)[:N]
    ks, vs, new_k, new_v, mapping = [], [], [], [], []
    for (start, n), slot, nb in zip(seqs, slots.tolist(), blocks):
        table[slot, :nb] = torch.tensor(order[:nb], dtype=torch.int32)
        order = order[nb:]
        k = torch.randn(start + n, K, Dh, generator=g).to(dtype)
        v = torch.randn(start + n, K, Dh, generator=g).to(dtype)
        pos = torch.arange(start + n)
        rows = table[slot, pos // BS].long() * BS + pos % BS  # flat row of each position
        k_cache.view(-1, K, Dh)[rows[:start]] = k[:start]
        v_cache.view(-1, K, Dh)[rows[:start]] = v[:start]
        ks.append(k), vs.append(v), new_k.append(k[start:]), new_v.append(v[start:]), mapping.append(rows[start:])
    T = sum(n for _, n in seqs)
    q = torch.randn(T, H, Dh, generator=g).to(dtype)
    k_cache, v_cache = k_cache.to(dev), v_cache.to(dev)
    write_kv(k_cache, v_cache, torch.cat(new_k).to(dev), torch.cat(new_v).to(dev), torch.cat(mapping).to(dev))
    cu = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    args = (q.to(dev), k_cache, v_cache, table.to(dev), slots.to(torch.int32).to(dev),
            torch.tensor([s for s, _ in seqs], dtype=torch.int32).to(dev), cu.to(dev), max(n for _, n in seqs))
    return args, ks, vs


def _dense(q, ks, vs, seqs, window=0, sinks=None):
    """Independent of the module: per sequence every score [H, n, end] in fp32, masked from positions
    (j <= p, and j > p - W), softmax over [scores, sink] with the sink column dropped -> o [T, H, Dh] fp32."""
    H, Dh = q.shape[1:]
    outs, off = [], 0
    for (start, n), k, v in zip(seqs, ks, vs):
        G = H // k.shape[1]
        k = k.float().repeat_interleave(G, dim=1).transpose(0, 1)  # [H, end, Dh]
        v = v.float().repeat_interleave(G, dim=1).transpose(0, 1)
        scores = q[off:off + n].float().transpose(0, 1) @ k.transpose(1, 2) / Dh ** 0.5  # [H, n, end]
        q_pos, key_pos = torch.arange(start, start + n)[:, None], torch.arange(start + n)[None, :]
        allowed = (key_pos <= q_pos) & ((key_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(H, 1, 1).expand(H, n, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :start + n]
        outs.append((probs @ v).transpose(0, 1))  # [n, H, Dh]
        off += n
    return torch.cat(outs)


SINKS = [0.0, 1.5, -2.0, 8.0, -30.0, 3.0, 0.5, 20.0]  # some far above the scores (the sink takes nearly all)

# (seqs [(start, n)], H, K, Dh, window, sinks): a prompt from 0 · a cached prefix and a short query · packed
# sequences of different starts and lengths with a 1-token query · sliding windows (shorter than the prompt;
# a prefix beyond it; W = 1) · sinks with and without a window · GQA G = 1, 2, 4 and Dh 64 / 128 (and 80)
CASES = {
    "from_zero": ([(0, 37)], 4, 2, 64, 0, False),
    "cached_prefix": ([(45, 5)], 4, 2, 64, 0, False),
    "packed": ([(0, 9), (20, 1), (33, 14), (7, 3)], 4, 1, 64, 0, False),
    "window": ([(0, 37)], 4, 2, 64, 8, False),
    "window_prefix": ([(50, 12), (3, 6)], 2, 2, 128, 16, False),
    "sinks": ([(0, 21), (30, 4)], 8, 2, 64, 0, True),
    "sinks_window": ([(40, 9), (0, 13)], 8, 4, 64, 10, True),
    "mha_dh128": ([(5, 19)], 2, 2, 128, 0, False),
    "window_of_one": ([(3, 9)], 2, 1, 64, 1, False),  # each token sees itself only
    "head_dim_80": ([(2, 11)], 4, 2, 80, 0, True),  # Dh padded to 128 by masks
}


@pytest.mark.parametrize("BS", [16, 4, 6])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_and_reference_match_dense(name, BS):
    """Small tiles (16 rows, 16 keys): several query tiles per sequence, masked and unmasked key tiles."""
    seqs, H, K, Dh, window, with_sinks = CASES[name]
    args, ks, vs = _case(seqs, H, K, Dh, BS, seed=len(name) + BS)
    q = args[0]
    sinks = torch.tensor(SINKS[:H], device=q.device) if with_sinks else None
    ref = paged_prefill_attention_ref(*args, window=window, sinks=sinks)
    dense = _dense(q.cpu(), ks, vs, seqs, window, None if sinks is None else sinks.cpu())
    torch.testing.assert_close(ref.cpu(), dense, atol=1e-5, rtol=1e-5)
    got = paged_prefill_attention(*args, window=window, sinks=sinks, block_m=16, block_n=16)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if with_sinks:  # the sinks change the output
        assert not torch.allclose(ref, paged_prefill_attention_ref(*args, window=window), atol=1e-2)


@pytest.mark.parametrize("name", ["packed", "window_prefix", "sinks_window", "window_of_one"])
def test_default_tiles(name):
    """The launcher's own tile sizes (one query tile per sequence at these lengths)."""
    seqs, H, K, Dh, window, with_sinks = CASES[name]
    args, ks, vs = _case(seqs, H, K, Dh, 16, seed=3)
    sinks = torch.tensor(SINKS[:H], device=args[0].device) if with_sinks else None
    got = paged_prefill_attention(*args, window=window, sinks=sinks)
    torch.testing.assert_close(got.cpu(), _dense(args[0].cpu(), ks, vs, seqs, window,
                                                 None if sinks is None else sinks.cpu()), atol=1e-5, rtol=1e-5)


def test_write_kv_puts_each_token_at_its_row():
    K, Dh, BS = 2, 8, 4
    kc, vc = torch.zeros(5, BS, K, Dh), torch.zeros(5, BS, K, Dh)
    k, v = torch.randn(3, K, Dh), torch.randn(3, K, Dh)
    write_kv(kc, vc, k, v, torch.tensor([13, 2, 7]))
    for i, row in enumerate([13, 2, 7]):
        assert torch.equal(kc[row // BS, row % BS], k[i]) and torch.equal(vc[row // BS, row % BS], v[i])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3


def test_reference_long_context_stays_bounded(monkeypatch):
    """20,000 cached keys and a 384-token chunk: the reference never builds a score or mask tensor over
    MAX_SCORE_ELEMENTS (every SDPA call recorded), needs more than one query chunk for it, and its rows equal
    an unchunked computation over all keys."""
    seqs, H, K, Dh = [(20_000, 384)], 8, 2, 16
    args, ks, vs = _case(seqs, H, K, Dh, 16, seed=5, device=torch.device("cpu"))
    sizes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        sizes.append((q.shape[:-1].numel() * k.shape[-2], 0 if attn_mask is None else attn_mask.numel()))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    o = paged_prefill_attention_ref(*args)
    assert len(sizes) > 1 and max(max(s) for s in sizes) <= ppa.MAX_SCORE_ELEMENTS
    assert sum(s for s, _ in sizes) > ppa.MAX_SCORE_ELEMENTS  # the whole problem would not have fit
    rows = torch.tensor([0, 1, 200, 383])  # in the first and the last chunk
    q, k, v = args[0][rows].transpose(0, 1), ks[0].transpose(0, 1), vs[0].transpose(0, 1)  # [H, 4, Dh], [K, L, Dh]
    mask = torch.arange(20_384)[None, :] <= (20_000 + rows)[:, None]
    want = sdpa(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(o[rows], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, with_sinks", [(0, False), (7, False), (0, True), (5, True)])
def test_reference_in_many_chunks(monkeypatch, window, with_sinks):
    """A score budget of a few rows: every sequence goes in several query chunks, each with its own key
    range (a prefix of the sequence's keys, or the window's), and still equals the dense computation."""
    seqs, H = [(0, 23), (11, 17), (30, 1)], 4
    args, ks, vs = _case(seqs, H, 2, 16, 4, seed=7)
    sinks = torch.tensor(SINKS[:H], device=args[0].device) if with_sinks else None
    monkeypatch.setattr(ppa, "MAX_SCORE_ELEMENTS", H * 160)  # r (r + first) <= 160: r <= 12, then fewer
    chunks = []
    attend = ppa._attend_chunk
    monkeypatch.setattr(ppa, "_attend_chunk", lambda qc, *a: chunks.append(len(qc)) or attend(qc, *a))
    o = paged_prefill_attention_ref(*args, window=window, sinks=sinks)
    assert len(chunks) >= 2 * len(seqs) and sum(chunks) == 41
    torch.testing.assert_close(o.cpu(), _dense(args[0].cpu(), ks, vs, seqs, window,
                                               None if sinks is None else sinks.cpu()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (lambda a: (a[0][:, :3],) + a[1:], r"do not fit \[T, H, Dh\]"),  # H = 3 not a multiple of K = 2
    (lambda a: a[:6] + (a[6][:-1],) + a[7:], r"cu_query \(1,\)"),
    (lambda a: a[:3] + (a[3].float(),) + a[4:], "integer tensors"),
    (lambda a: a[:2] + (a[2].double(),) + a[3:], "differ in dtype"),
])
def test_bad_arguments_are_refused(bad, match):
    args, _, _ = _case([(0, 4)], 4, 2, 16, 4)
    for fn in (paged_prefill_attention, paged_prefill_attention_ref):
        with pytest.raises(ValueError, match=match):
            fn(*bad(args))
    with pytest.raises(ValueError, match=r"sinks \(2,\) do not fit \[H\]"):
        paged_prefill_attention(*args, sinks=torch.zeros(2, device=args[0].device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window, with_sinks", [(0, False), (128, True)])
def test_bf16_real_size_cuda(window, with_sinks):
    """A 4096-token chunk after a 2048-token prefix and a second short sequence, Qwen3-30B-A3B's attention
    geometry (32 query heads, 4 kv heads, Dh 128), bf16 against the reference in fp32."""
    seqs = [(2048, 4096), (100, 37)]
    args, _, _ = _case(seqs, 32, 4, 128, 16, dtype=torch.bfloat16, seed=9)
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(1)).cuda() if with_sinks else None
    got = paged_prefill_attention(*args, window=window, sinks=sinks)
    q, kc, vc = (t.float() for t in args[:3])
    ref = paged_prefill_attention_ref(q, kc, vc, *args[3:], window=window, sinks=sinks)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
