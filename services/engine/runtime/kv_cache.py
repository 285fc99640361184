"""The KV cache and the description of one forward step's batch.

KVCache is preallocated once: per decoder layer one K and one V tensor ``[S, M, K, Dh]``
(S = slots, one per running request · M = max_seq_len · K kv heads · Dh head dim). A request keeps
its slot for its whole life; token ``p`` of the request lives at ``[slot, p]``.

ForwardBatch says which tokens a forward step carries: sequence ``i`` has ``query_lens[i]`` new
tokens (contiguous in the flat token list), ``start_pos[i]`` tokens already in the cache and the
cache slot ``slots[i]``. A decode step is ``query_lens == [1] * B``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    slots: list[int]  # cache slot of each sequence
    start_pos: list[int]  # tokens of each sequence already in the cache
    query_lens: list[int]  # new tokens of each sequence in this step (contiguous in the flat input)
    # Optional static window for decode attention (keys [0, kv_len) of each slot, masked by
    # position). None = max(start_pos) + 1. A CUDA-graph runner fixes it (e.g. max_seq_len) so the
    # captured shapes never change between replays.
    kv_len: int | None = None
    # Device copies of `slots` ([B] int64). Built lazily by `slot_tensor`; a CUDA-graph runner sets
    # a static tensor it updates in place before each replay (no host->device copy inside capture).
    slot_ids: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.start_pos) == len(self.query_lens)):
            raise ValueError(f"ForwardBatch: slots, start_pos and query_lens differ in length "
                             f"({len(self.slots)}, {len(self.start_pos)}, {len(self.query_lens)})")
        if any(q <= 0 for q in self.query_lens):
            raise ValueError(f"ForwardBatch: every query_len must be positive, got {self.query_lens}")

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: attention takes the batched (graph-capturable) path."""
        return all(q == 1 for q in self.query_lens)

    def slot_tensor(self, device: torch.device) -> torch.Tensor:
        """``[B]`` int64 slot ids on ``device`` (cached)."""
        if self.slot_ids is None or self.slot_ids.device != torch.device(device):
            self.slot_ids = torch.tensor(self.slots, dtype=torch.long, device=device)
        return self.slot_ids

    def last_token_index(self) -> list[int]:
        """Flat index of each sequence's last new token (where logits are taken)."""
        out, end = [], 0
        for q in self.query_lens:
            end += q
            out.append(end - 1)
        return out

    @staticmethod
    def single(slot: int, start_pos: int, num_tokens: int) -> "ForwardBatch":
        return ForwardBatch(slots=[slot], start_pos=[start_pos], query_lens=[num_tokens])


class KVCache:
    """Preallocated K/V for every decoder layer: ``k[layer]``, ``v[layer]`` are ``[S, M, K, Dh]``."""

    def __init__(self, spec, num_slots: int, max_seq_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.num_slots = num_slots  # S
        self.max_seq_len = max_seq_len  # M
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (num_slots, max_seq_len, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]

    @staticmethod
    def nbytes_per_token(spec, dtype: torch.dtype) -> int:
        """Bytes one token of one sequence occupies across all layers (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the K/V of positions ``[0, num_tokens)`` from slot ``src`` to slot ``dst`` in every layer
        (the prefix cache; queued on the current stream like the forward that follows)."""
        for cache in (*self.k, *self.v):
            cache[dst, :num_tokens].copy_(cache[src, :num_tokens])

    def check(self, batch: ForwardBatch) -> None:
        """Raise if the batch addresses a slot or a position outside the cache."""
        if batch.kv_len is not None and not 0 < batch.kv_len <= self.max_seq_len:
            raise ValueError(f"ForwardBatch.kv_len {batch.kv_len} outside (0, {self.max_seq_len}]")
        for slot, start, q in zip(batch.slots, batch.start_pos, batch.query_lens):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"KV slot {slot} out of range [0, {self.num_slots})")
            if start + q > self.max_seq_len:
                raise ValueError(f"sequence in slot {slot} needs {start + q} positions, "
                                 f"KV cache holds {self.max_seq_len} (--max-seq-len)")
