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


def upload(values: list[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` without a host sync: on CUDA through pinned memory with a
    non-blocking copy (a pageable copy, ``torch.tensor(values, device=cuda)``, waits for the stream first: the
    host stops issuing until the GPU has drained what was queued; the caching host allocator keeps the pinned
    block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class ForwardBatch:
    slots: list[int]  # cache slot of each sequence
    start_pos: list[int]  # tokens of each sequence already in the cache
    query_lens: list[int]  # new tokens of each sequence in this step (contiguous in the flat input)
    # Optional static window for decode attention (keys [0, kv_len) of each slot, masked by
    # position). None = max(start_pos) + 1 (the torch path; the Triton kernel takes the whole cache
    # then, models/attention.py: one specialization for every step). A CUDA-graph runner fixes it (e.g.
    # max_seq_len) so the captured shapes never change between replays.
    kv_len: int | None = None
    # Device copies of `slots` ([B] int64). Built lazily by `slot_tensor`; a CUDA-graph runner sets
    # a static tensor it updates in place before each replay (no host->device copy inside capture).
    slot_ids: torch.Tensor | None = field(default=None, repr=False)
    # Packed-prefill index tensors and masks (``packed``), built once per forward and shared by its layers.
    _packed: dict = field(default_factory=dict, repr=False, compare=False)

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

    def packed(self, device: torch.device) -> "PackedPrefill":
        """The step's sequences as one packed attention problem (``PackedPrefill``), cached per device."""
        key = torch.device(device)
        if key not in self._packed:
            self._packed[key] = PackedPrefill.build(self, key)
        return self._packed[key]

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


@dataclass
class PackedPrefill:
    """All sequences of a prefill / mixed step as ONE attention problem (T new tokens, Tk keys): the new
    tokens' cache addresses (``tok_slot``/``tok_pos`` [T]: one K and one V write per layer) and the keys
    they attend to, each sequence's ``[0, start + n)`` of its slot (``key_slot``/``key_pos`` [Tk]: one
    gather per layer), with the sequence of every token and key so a block-diagonal causal bias keeps
    each sequence to its own keys. Per sequence this was ~5 launches per layer (two K/V writes, SDPA,
    mask aranges); packed it is 5 whatever the number of sequences (docs/serving.md)."""

    tok_slot: torch.Tensor  # [T] int64
    tok_pos: torch.Tensor  # [T] int64
    key_slot: torch.Tensor  # [Tk] int64
    key_pos: torch.Tensor  # [Tk] int64
    tok_seq: torch.Tensor  # [T] int64: index of the token's sequence in the batch
    key_seq: torch.Tensor  # [Tk] int64
    biases: dict = field(default_factory=dict, repr=False)  # (dtype, window, G) -> [T G, Tk] additive bias

    @property
    def num_keys(self) -> int:
        return self.key_pos.shape[0]

    @staticmethod
    def build(batch: ForwardBatch, device: torch.device) -> "PackedPrefill":
        cols: list[list[int]] = [[], [], [], [], [], []]  # tok_slot, tok_pos, tok_seq, key_slot, key_pos, key_seq
        for i, (slot, start, n) in enumerate(zip(batch.slots, batch.start_pos, batch.query_lens)):
            end = start + n
            cols[0] += [slot] * n
            cols[1] += range(start, end)
            cols[2] += [i] * n
            cols[3] += [slot] * end
            cols[4] += range(end)
            cols[5] += [i] * end
        T = len(cols[0])
        flat = upload([x for c in cols for x in c], device)  # one host->device copy, no sync
        tok, keys = flat[:3 * T].view(3, T), flat[3 * T:].view(3, -1)
        return PackedPrefill(tok[0], tok[1], keys[0], keys[1], tok[2], keys[2])

    def bias(self, window: int | None, dtype: torch.dtype, rows_per_token: int = 1) -> torch.Tensor:
        """[T G, Tk] additive bias in ``dtype``, G = ``rows_per_token`` rows per token (its query heads of
        one kv head, rows t G .. t G + G - 1): 0 where a token may see a key (same sequence, key position
        <= its own, and within ``window`` when set: key > pos - window, as transformers), -inf elsewhere.
        Every token sees at least itself, so no row is all -inf."""
        key = (dtype, window, rows_per_token)
        if key not in self.biases:
            q_pos, k_pos = self.tok_pos[:, None], self.key_pos[None, :]
            allowed = (self.tok_seq[:, None] == self.key_seq[None, :]) & (k_pos <= q_pos)
            if window is not None:
                allowed &= k_pos > q_pos - window
            zero = torch.zeros((), dtype=dtype, device=allowed.device)
            bias = torch.where(allowed, zero, float("-inf"))  # [T, Tk]
            T, Tk, G = bias.shape[0], bias.shape[1], rows_per_token
            # rows padded to a multiple of 16 elements: CUDA's memory-efficient SDPA copies a bias whose
            # row stride is not aligned, i.e. once per layer; this view of an aligned buffer it takes as is
            padded = bias.new_empty((T * G, -(-Tk // 16) * 16))
            padded[:, :Tk] = bias[:, None].expand(T, G, Tk).reshape(T * G, Tk)  # row t G + g = token t
            self.biases[key] = padded[:, :Tk]
        return self.biases[key]
