"""Self-attention with GQA, RoPE, optional q/k norm, sliding windows and sinks over the paged KV cache.

Legend: T tokens in the step · B sequences · H query heads · K kv heads · G = H/K query heads per kv
head · Dh head dim · NB KV blocks · BS tokens per block.

Two paths, same maths, both reading K/V through the block table (runtime/kv_cache.py):
- prefill / mixed steps: the new tokens' K/V are scattered into their blocks, then all the step's
  sequences attend in ONE call per layer (kernels/paged_prefill_attention.py: a Triton flash-attention
  kernel on CUDA, its torch reference on the CPU), causal from each sequence's cached prefix, within the
  sliding window, with gpt-oss's sinks; memory O(T), never a T x T mask (the old packed SDPA bias asked
  for 35 GiB at a 17k-token prompt after a prefix-cache hit);
- decode steps (one token per sequence): no Python-int-dependent shapes, so a runner can capture it in a
  CUDA graph; one Triton kernel writes the new K/V and attends over the row's own context
  (kernels/decode_attention.py), the reference on the CPU.

A bs=1 decode step is launch-bound, so q/k/v are one matmul (``LinearGroup``) and q/k norm + rope one
in-place kernel on CUDA (benchmarks/count_decode_ops.py counts the kernels per layer).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models import fused
from services.engine.models.fused import LinearGroup
from services.engine.models.norm import RMSNorm
from services.engine.models.rope import apply_rotary
from services.engine.models.spec import ModelSpec, QKNorm
from services.engine.runtime.kv_cache import ForwardBatch, KVCache



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
                batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """x [T, D] · positions [T] · cos/sin [T, Dh] -> [T, D]; writes this layer's K/V into ``kv``."""
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
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # [NB, BS, K, Dh]
        if batch.is_decode:  # one kernel on CUDA: KV write + attention through the block table
            # W bounds the positions only: the kernel walks each row's own context (kernels/decode_attention.py)
            args = (q, k, v, k_cache, v_cache, kv.block_table, batch.slot_tensor(q.device), positions,
                    self.window or 0, batch.kv_len or kv.max_seq_len)
            o = fused.call("decode_attention", "decode_attention", "decode_attention", *args, sinks=self.sinks)
            if o is None:
                o = fused.kernel("decode_attention", "decode_attention_ref")(*args, sinks=self.sinks)
        else:
            o = self._prefill(q, k, v, batch, kv, k_cache, v_cache)
        return fused.linear(o.reshape(T, H * Dh), self.o_proj.weight, self.o_proj.bias)

    def _prefill(self, q, k, v, batch: ForwardBatch, kv: KVCache, k_cache, v_cache) -> torch.Tensor:
        """q [T, H, Dh], k/v [T, K, Dh] -> o [T, H, Dh]: the new tokens' K/V written into their blocks (one
        scatter each), then every sequence of the step attends over its slot's blocks in one call, never
        materialising T x T (kernels/paged_prefill_attention.py; its memory-bounded torch reference on the CPU)."""
        p = batch.packed(q.device)
        fused.kernel("paged_prefill_attention", "write_kv")(k_cache, v_cache, k, v, p.slot_mapping(kv))  # [T] rows
        args = (q, k_cache, v_cache, kv.block_table, p.seq_slots, p.seq_start, p.cu_query, p.max_query_len,
                self.window or 0, self.sinks)
        o = fused.call("prefill_attention", "paged_prefill_attention", "paged_prefill_attention", *args)
        if o is None:
            o = fused.kernel("paged_prefill_attention", "paged_prefill_attention_ref")(*args)
        return o
