"""Self-attention with GQA, RoPE, optional q/k norm and the slot KV cache.

Legend: T tokens in the step · B sequences · H query heads · K kv heads · G = H/K query heads per kv
head · Dh head dim · W attended key window · M max_seq_len.

Two paths, same maths:
- prefill / mixed steps: every sequence writes its new K/V into its slot and attends causally over
  ``[0, start + q)`` of it; the sequences go packed into ONE SDPA call per layer with a block-diagonal
  causal bias (``PackedPrefill``, built once per forward), so a step's launches do not grow with its
  sequences (a 24-layer step of 4 prompts + 16 decode rows was ~108 attention launches per layer);
  one long sequence or gpt-oss's sinks attend per sequence (GQA inside SDPA);
- decode steps (one token per sequence): batched, no Python-int-dependent shapes once ``kv_len`` is
  fixed, so a runner can capture it in a CUDA graph. On CUDA one Triton kernel writes the new K/V and
  attends over the slot's cache in place (kernels/decode_attention.py; sliding windows and gpt-oss's
  sinks included); the torch path gathers the window and runs SDPA with the G query heads sharing a kv
  head laid out as G "query rows" of that kv head, so K/V are never repeated.

A bs=1 decode step is launch-bound, so q/k/v are one matmul (``LinearGroup``) and q/k norm + rope one
in-place kernel on CUDA (benchmarks/count_decode_ops.py counts the kernels per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.engine.models import fused
from services.engine.models.fused import LinearGroup
from services.engine.models.norm import RMSNorm
from services.engine.models.rope import apply_rotary
from services.engine.models.spec import ModelSpec, QKNorm
from services.engine.runtime.kv_cache import ForwardBatch, KVCache


SINK_BIAS_ELEMENTS = 1 << 25  # prefill with sinks: most bias elements per SDPA call (64 MiB in bf16)
# Packed prefill (one SDPA over all the step's sequences, block-diagonal causal bias [G T, Tk]): at most
# this many bias elements (64 MiB in bf16). Packing wastes (B - 1) / B of the scores of B sequences, nothing
# next to a step's launches while the bias is small (16 prompts of 100 tokens at G = 8: 20 M); past it
# (long prompts: compute-bound, few sequences) each sequence attends alone.
PACK_MAX_ELEMENTS = 1 << 25
# Prefill SDPA backends: never cuDNN. torch >= 2.10 with its bundled cuDNN >= 9.15 tries cuDNN attention first
# on sm90 / sm100, and cuDNN builds an execution plan for every new shape (reported 0.1-0.45 s each); prompt
# lengths, and packed steps' (T, Tk), are nearly always new, so every prefill would pay one. Flash takes
# the causal calls, memory-efficient the biased ones, math what neither takes (and the CPU's own kernels).
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        D, H, K, Dh = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.layer, self.H, self.K, self.Dh = layer, H, K, Dh
        self.q_proj = nn.Linear(D, H * Dh, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(D, K * Dh, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(D, K * Dh, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=spec.o_bias)
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)  # one [(H + 2K) * Dh, D] matmul
        self.qk_norm = spec.traits.qk_norm
        if self.qk_norm is QKNorm.PER_HEAD:
            self.q_norm = RMSNorm(Dh, spec.rms_norm_eps)
            self.k_norm = RMSNorm(Dh, spec.rms_norm_eps)
        elif self.qk_norm is QKNorm.FULL:
            self.q_norm = RMSNorm(H * Dh, spec.rms_norm_eps)
            self.k_norm = RMSNorm(K * Dh, spec.rms_norm_eps)
        self.clip_qkv = spec.clip_qkv
        self.window = spec.window(layer)  # None = full causal attention
        # gpt-oss: per query head a learned logit that joins every softmax and whose value is dropped
        # (transformers' eager_attention_forward); computed as one extra key with K = V = 0 and bias = sink
        self.sinks = nn.Parameter(torch.zeros(H)) if spec.traits.attention_sinks else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVCache, decode_bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] · positions [T] · cos/sin [T, Dh] -> [T, D]; writes this layer's K/V into ``kv``.
        ``decode_bias`` [B, 1, 1, W] (decode steps; from ``decode_bias``, built once per step for all
        layers; or a dict window -> bias when layers differ) — computed here when None."""
        T, H, K, Dh = x.shape[0], self.H, self.K, self.Dh
        qkv = self.qkv(x)  # [T, (H + 2K) * Dh]: one matmul
        if self.clip_qkv is None and self.qk_norm is not QKNorm.FULL:
            # q and k are adjacent heads of qkv: norm + rope them in place, one launch on CUDA
            qk = qkv[:, :(H + K) * Dh].view(T, H + K, Dh)  # [T, H + K, Dh]
            per_head = self.qk_norm is QKNorm.PER_HEAD
            done = fused.call("qk_norm_rope", "qk_norm_rope", "qk_norm_rope_", qk, H, cos, sin,
                              self.q_norm.weight if per_head else None, self.k_norm.weight if per_head else None,
                              self.q_norm.eps if per_head else 1e-6)
            q, k = qk[:, :H], qk[:, H:]  # [T, H, Dh], [T, K, Dh] (views of qkv; done in place on CUDA)
            if done is None:  # torch path
                if per_head:  # Qwen3: one [Dh] weight shared by all heads
                    q, k = self.q_norm(q), self.k_norm(k)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            q, k, v = qkv.split([H * Dh, K * Dh, K * Dh], dim=-1)  # [T, H*Dh], [T, K*Dh], [T, K*Dh]
            if self.qk_norm is QKNorm.FULL:  # OLMoE: norm over the whole projection, before the head split
                q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k))
            q, k = apply_rotary(q.reshape(T, H, Dh), cos, sin), apply_rotary(k.reshape(T, K, Dh), cos, sin)
        v = qkv[:, (H + K) * Dh:].view(T, K, Dh)  # [T, K, Dh]
        if self.clip_qkv is not None:
            v = v.clamp(-self.clip_qkv, self.clip_qkv)
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # [S, M, K, Dh]
        if batch.is_decode:  # on CUDA one kernel: KV write + attention over the slot's cache in place
            # The kernel's window is always the whole cache, as in the captured graphs (kv_len): the kernel
            # reads only keys below each row's position, and an eager all-query_len-1 forward (a prompt's
            # 1-token last chunk after a prefix-cache hit or a chunked prefill, a decode batch no graph fits)
            # then launches the specialization start-up compiled, not one per max(start_pos) + 1 (Triton
            # keys ints on == 1 and % 16: a 0.3 s compile on that request, tests/kernels/test_warm_covers_requests.py).
            o = fused.call("decode_attention", "decode_attention", "decode_attention", q, k, v, k_cache, v_cache,
                           batch.slot_tensor(q.device), positions, self.window or 0, batch.kv_len or kv.max_seq_len,
                           sinks=self.sinks)  # [B, H, Dh]
            if o is None:
                o = self._decode(q, k, v, positions, batch, k_cache, v_cache, decode_bias)
        else:
            o = self._prefill(q, k, v, batch, k_cache, v_cache)
        return fused.linear(o.reshape(T, H * Dh), self.o_proj.weight, self.o_proj.bias)

    def _prefill(self, q, k, v, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """q [T, H, Dh], k/v [T, K, Dh] -> o [T, H, Dh]: several sequences packed into one attention call
        (``PackedPrefill``: one K/V write, one key gather, one SDPA per layer), or per sequence (one
        sequence, gpt-oss's sinks, or a packed bias past PACK_MAX_ELEMENTS)."""
        with sdpa_kernel(PREFILL_BACKENDS):
            T, G = q.shape[0], self.H // self.K
            if (batch.num_seqs > 1 and self.sinks is None
                    and G * T * (sum(batch.start_pos) + T) <= PACK_MAX_ELEMENTS):
                return self._prefill_packed(q, k, v, batch, k_cache, v_cache)
            return self._prefill_each(q, k, v, batch, k_cache, v_cache)

    def _prefill_each(self, q, k, v, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """One attention call per sequence (under ``_prefill``'s backend choice)."""
        outs, off = [], 0
        for slot, start, n in zip(batch.slots, batch.start_pos, batch.query_lens):
            end = start + n
            k_cache[slot, start:end] = k[off:off + n]
            v_cache[slot, start:end] = v[off:off + n]
            qs = q[off:off + n].transpose(0, 1)[None]  # [1, H, n, Dh]
            ks = k_cache[slot, :end].transpose(0, 1)[None]  # [1, K, end, Dh]
            vs = v_cache[slot, :end].transpose(0, 1)[None]  # [1, K, end, Dh]
            if self.sinks is not None:
                o = self._attend_with_sinks(qs, ks, vs, start)
            elif start == 0 and (self.window is None or end <= self.window):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:  # new tokens at positions [start, end) see keys [0, own position] (within the window)
                q_pos = torch.arange(start, end, device=q.device)
                mask = self._mask(torch.arange(end, device=q.device)[None, :], q_pos[:, None])  # [n, end]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))  # [n, H, Dh]
            off += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _prefill_packed(self, q, k, v, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """Every sequence of the step in one call: q [T, H, Dh], k/v [T, K, Dh] -> o [T, H, Dh]. The G query
        heads of a kv head go as G query rows of it (row t G + g: token t, head k G + g), as in ``_decode``:
        no GQA support asked of the biased kernel, K/V never repeated."""
        T, K, G, Dh = q.shape[0], self.K, self.H // self.K, self.Dh
        p = batch.packed(q.device)
        k_cache[p.tok_slot, p.tok_pos] = k  # one scatter each for K and V
        v_cache[p.tok_slot, p.tok_pos] = v
        ks = k_cache[p.key_slot, p.key_pos].transpose(0, 1)[None]  # [1, K, Tk, Dh]
        vs = v_cache[p.key_slot, p.key_pos].transpose(0, 1)[None]  # [1, K, Tk, Dh]
        qg = q.view(T, K, G, Dh).transpose(0, 1).reshape(1, K, T * G, Dh)  # [1, K, T G, Dh]
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=p.bias(self.window, q.dtype, G))  # [1, K, T G, Dh]
        return o.view(K, T, G, Dh).transpose(0, 1).reshape(T, self.H, Dh)  # [T, H, Dh]

    def _attend_with_sinks(self, qs, ks, vs, start: int) -> torch.Tensor:
        """Prefill with sinks: qs [1, H, n, Dh] (positions [start, start + n)) · ks/vs [1, K, W, Dh] ->
        [1, H, n, Dh]. The sink is key W: K = V = 0 (no value) and an additive bias of sinks[h], so the
        softmax is transformers' softmax over [scores, sink] with the sink's share dropped. The bias is
        per head ([H, rows, W + 1]), so the queries go in blocks of SINK_BIAS_ELEMENTS / (H (W + 1)) rows:
        a whole 4096-token prompt of gpt-oss (64 heads) would need a 2 GiB bias."""
        n, W, H = qs.shape[2], ks.shape[2], self.H
        zero = ks.new_zeros(ks.shape[:2] + (1, ks.shape[3]))  # [1, K, 1, Dh]
        ks, vs = torch.cat([ks, zero], dim=2), torch.cat([vs, zero], dim=2)  # [1, K, W + 1, Dh]
        sink = self.sinks.to(qs.dtype)[:, None, None]  # [H, 1, 1]
        rows = max(1, SINK_BIAS_ELEMENTS // (H * (W + 1)))
        outs = []
        for r0 in range(0, n, rows):
            q_pos = torch.arange(start + r0, start + min(n, r0 + rows), device=qs.device)
            mask = self._mask(torch.arange(W, device=qs.device)[None, :], q_pos[:, None])  # [r, W]
            bias = torch.where(mask, 0.0, float("-inf")).to(qs.dtype)  # [r, W]
            bias = torch.cat([bias[None].expand(H, -1, -1), sink.expand(H, len(q_pos), 1)], dim=-1)  # [H, r, W + 1]
            outs.append(F.scaled_dot_product_attention(qs[:, :, r0:r0 + rows], ks, vs, attn_mask=bias[None],
                                                       enable_gqa=True))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def _mask(self, key_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Boolean attend-mask (broadcast of key_pos [1, W] and q_pos [n, 1]): causal, and within the
        sliding window when the model has one (transformers: kv_idx > q_idx - sliding_window)."""
        mask = key_pos <= q_pos
        if self.window is not None:
            mask &= key_pos > q_pos - self.window
        return mask

    def _decode(self, q, k, v, positions, batch: ForwardBatch, k_cache, v_cache, bias) -> torch.Tensor:
        """One token per sequence: q [B, H, Dh], k/v [B, K, Dh], positions [B] -> o [B, H, Dh]."""
        B = q.shape[0]
        slots = batch.slot_tensor(q.device)  # [B]
        k_cache[slots, positions] = k
        v_cache[slots, positions] = v
        W = batch.kv_len or (max(batch.start_pos) + 1)
        ks = k_cache[:, :W][slots].transpose(1, 2)  # [B, K, W, Dh]
        vs = v_cache[:, :W][slots].transpose(1, 2)  # [B, K, W, Dh]
        if bias is None:
            bias = decode_bias(positions, W, self.window, q.dtype)
        elif isinstance(bias, dict):  # one per window size (gpt-oss alternates sliding and full layers)
            bias = bias[self.window]
        G = self.H // self.K
        qg = q.reshape(B, self.K, G, self.Dh)  # query head h = kv head (h // G), as transformers' repeat_kv
        if self.sinks is not None:  # one more key, K = V = 0, bias sinks[h] (see _attend_with_sinks)
            zero = ks.new_zeros((B, self.K, 1, self.Dh))
            ks, vs = torch.cat([ks, zero], dim=2), torch.cat([vs, zero], dim=2)  # [B, K, W + 1, Dh]
            sink = self.sinks.to(q.dtype).view(1, self.K, G, 1).expand(B, -1, -1, -1)  # [B, K, G, 1]
            bias = torch.cat([bias.expand(B, self.K, G, W), sink], dim=-1)  # [B, K, G, W + 1]
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=bias)  # [B, K, G, Dh]
        return o.reshape(B, self.H, self.Dh)


def decode_bias(positions: torch.Tensor, W: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias of a decode step, [B, 1, 1, W] in ``dtype``: 0 where key position j may be
    seen by the token at ``positions[b]`` (j <= p, and j > p - window with a sliding window), -inf
    elsewhere. The same for every layer, so a forward builds it once (a float bias also spares SDPA
    its per-call bool -> float conversion)."""
    key_pos = torch.arange(W, device=positions.device)[None, :]  # [1, W]
    q_pos = positions[:, None]  # [B, 1]
    allowed = key_pos <= q_pos
    if window is not None:
        allowed &= key_pos > q_pos - window
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(allowed, zero, float("-inf"))[:, None, None, :]
