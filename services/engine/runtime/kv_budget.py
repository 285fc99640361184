"""How much memory the paged KV pool gets, and the context a request may use (--max-seq-len).

- ``--max-seq-len`` unset: the model's own trained context (config.json's ``max_position_embeddings``:
  40,960 for Qwen3-30B-A3B, 131,072 for gpt-oss). Nothing is reserved per request for it any more (the
  pool is shared, block_manager.py), so the model's context costs nothing until a prompt uses it.
- ``--kv-cache-memory GiB``: the pool's size, explicitly.
- unset (auto): room for one request of the whole context plus ``AUTO_TOKENS_PER_REQUEST`` tokens for each
  other running request — one long prompt among short chats, or several mid-length ones, all resident
  together; more requests than fit are preempted and recomputed, not refused. On a small card this share
  is taken before the expert cache's (--moe-cache-auto fills what is left): a 32k prompt must answer.
Either way the pool must hold one request of --max-seq-len, or the engine refuses to start.

The prefill workspace: a step of --max-prefill-tokens tokens holds its activations for a moment (hidden
states, q/k/v, the routed tokens' expert inputs and outputs); ``prefill_workspace_bytes`` estimates them
from the geometry, and the expert cache's sizing keeps them free beside the KV pool, so with
--gpu-memory-limit (which the engine hands to torch's allocator as a hard cap) a long prompt's chunk fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.config import EngineConfig
from services.engine.moe.sizing import GiB, fmt_bytes
from services.engine.runtime.kv_cache import BLOCK_SIZE, KVCache

AUTO_TOKENS_PER_REQUEST = 4096


def resolve_max_seq_len(config: EngineConfig, spec) -> int:
    """--max-seq-len, defaulting to the model's trained context (set on ``config`` once)."""
    if config.max_seq_len is None:
        config.max_seq_len = int(spec.max_position_embeddings)
    return config.max_seq_len


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int  # the pool's blocks, the null block included
    block_size: int
    nbytes: int  # device (or host, on the CPU) bytes of the pool
    how: str  # which flag decided, with the inputs

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def describe(self) -> str:
        return f"{self.tokens} tokens in {self.num_blocks - 1} blocks of {self.block_size} = {fmt_bytes(self.nbytes)} ({self.how})"


def prefill_workspace_bytes(config: EngineConfig, spec, dtype) -> int:
    """Transient bytes of one prefill step of --max-prefill-tokens tokens (module docstring): per token the
    residual stream and norms (~6 rows of the hidden size), q/k/v and attention output (~3 of (H + 2K) Dh),
    and per routed expert its gate/up, activation and down rows (4 x the expert width + 2 x hidden)."""
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_token = 6 * spec.hidden_size + 3 * qkv + spec.top_k * (4 * spec.moe_intermediate_size + 2 * spec.hidden_size)
    return config.max_prefill_tokens * per_token * dtype.itemsize


def decide_kv_budget(config: EngineConfig, spec, dtype) -> KVBudget:
    """The pool for ``config`` (module docstring); ValueError when it cannot hold one --max-seq-len request."""
    max_len = resolve_max_seq_len(config, spec)
    per_block = KVCache.nbytes_per_token(spec, dtype) * BLOCK_SIZE
    if config.kv_cache_memory is not None:
        blocks = int(config.kv_cache_memory * GiB) // per_block
        how = f"--kv-cache-memory {config.kv_cache_memory:g}"
    else:
        others = config.max_running_requests - 1
        tokens = max_len + others * min(max_len, AUTO_TOKENS_PER_REQUEST)
        blocks = -(-tokens // BLOCK_SIZE)
        how = (f"auto: one request of --max-seq-len {max_len} + {others} x {min(max_len, AUTO_TOKENS_PER_REQUEST)} "
               "tokens for the other running requests")
    if blocks * BLOCK_SIZE < max_len:
        raise ValueError(f"{how}: a KV pool of {blocks * BLOCK_SIZE} tokens ({fmt_bytes(blocks * per_block)}) cannot "
                         f"hold one request of --max-seq-len {max_len} ({fmt_bytes(-(-max_len // BLOCK_SIZE) * per_block)}); "
                         "give more --kv-cache-memory or a smaller --max-seq-len")
    return KVBudget(blocks + 1, BLOCK_SIZE, (blocks + 1) * per_block, how)
