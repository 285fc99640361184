"""The paged KV cache and the description of one forward step's batch.

KVCache is one pool of fixed-size blocks, allocated once: per decoder layer one K and one V tensor
``[NB, BS, K, Dh]`` (NB blocks · BS tokens per block · K kv heads · Dh head dim), and a block table
``[S, MB]`` int32 on the device (S request slots · MB = ceil(max_seq_len / BS)): token ``p`` of the
request in slot ``s`` lives at ``[block_table[s, p // BS], p % BS]``. Block 0 is the null block, which
padding rows read and write. Who owns which block is the BlockManager's business (block_manager.py);
the runner copies its host table here (``load_tables``) before a forward when it changed.

A KVCache built without ``num_blocks`` is dense: every slot owns the blocks for max_seq_len tokens from
the start (benchmarks and tests that drive the model directly, without a scheduler).

ForwardBatch says which tokens a forward step carries: sequence ``i`` has ``query_lens[i]`` new
tokens (contiguous in the flat token list), ``start_pos[i]`` tokens already in the cache and the
request slot ``slots[i]``. A decode step is ``query_lens == [1] * B``.
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
    slots: list[int]  # request slot (block-table row) of each sequence
    start_pos: list[int]  # tokens of each sequence already in the cache
    query_lens: list[int]  # new tokens of each sequence in this step (contiguous in the flat input)
    # Optional static bound on decode positions (positions < kv_len) that the decode kernel is built for;
    # None = the cache's max_seq_len. The kernel walks each row's own context whatever the bound
    # (kernels/decode_attention.py), so a CUDA-graph runner fixes it and every replay fits.
    kv_len: int | None = None
    # Device copies of `slots` ([B] int64). Built lazily by `slot_tensor`; a CUDA-graph runner sets
    # a static tensor it updates in place before each replay (no host->device copy inside capture).
    slot_ids: torch.Tensor | None = field(default=None, repr=False)
    # The step's prefill index tensors (``packed``), built once per forward and shared by its layers.
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


BLOCK_SIZE = 16  # tokens per KV block: a prefix is shared in whole blocks, and a request wastes < one block


class KVCache:
    """The K/V pool of every decoder layer, ``k[layer]``/``v[layer]`` ``[NB, BS, K, Dh]``, and the block
    table ``[S, MB]`` (module docstring). ``num_blocks`` None: dense, each slot owns max_seq_len tokens."""

    def __init__(self, spec, num_slots: int, max_seq_len: int, device: torch.device | str,
                 dtype: torch.dtype, num_blocks: int | None = None, block_size: int = BLOCK_SIZE) -> None:
        self.num_slots = num_slots  # S
        self.max_seq_len = max_seq_len
        self.block_size = block_size  # BS
        self.max_blocks = -(-max_seq_len // block_size)  # MB
        self.device = torch.device(device)
        self.dtype = dtype
        dense = num_blocks is None
        self.num_blocks = 1 + num_slots * self.max_blocks if dense else num_blocks  # NB, the null block included
        shape = (self.num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        table = torch.zeros((num_slots, self.max_blocks), dtype=torch.int32)
        if dense:  # slot s: blocks 1 + s MB .. (s + 1) MB
            table += torch.arange(self.max_blocks, dtype=torch.int32) + 1
            table += torch.arange(num_slots, dtype=torch.int32)[:, None] * self.max_blocks
        self.block_table = table.to(self.device)  # [S, MB]

    @staticmethod
    def nbytes_per_token(spec, dtype: torch.dtype) -> int:
        """Bytes one token of one sequence occupies across all layers (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def load_tables(self, host_table: torch.Tensor, cols: int) -> None:
        """Copy the first ``cols`` columns of a BlockManager's ``host_table`` [S, MB] to the device, queued
        on the current stream without a host sync (through a pinned copy of its own: the host table may
        change again before the copy runs)."""
        src = host_table[:, :cols].contiguous()
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.block_table[:, :cols].copy_(src, non_blocking=self.device.type == "cuda")

    def slot_mapping(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] int64 flat row of each (slot, position) in a layer's pool viewed as [NB BS, K, Dh]."""
        blocks = self.block_table[slots, torch.div(positions, self.block_size, rounding_mode="floor")]
        return blocks.long() * self.block_size + positions % self.block_size

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
    """All sequences of a prefill / mixed step as one attention problem over the paged cache: each new
    token's slot and position (``tok_slot``/``tok_pos`` [T]: where its K/V go), and per sequence its slot,
    its tokens already cached and where its new tokens start in the flat list (``seq_slots``/``seq_start``
    [N], ``cu_query`` [N + 1], int32: what the prefill attention kernel walks). Built once per forward on
    the device (one host->device copy) and shared by its layers."""

    tok_slot: torch.Tensor  # [T] int64
    tok_pos: torch.Tensor  # [T] int64
    seq_slots: torch.Tensor  # [N] int32
    seq_start: torch.Tensor  # [N] int32
    cu_query: torch.Tensor  # [N + 1] int32
    max_query_len: int
    rows: torch.Tensor | None = field(default=None, repr=False)  # slot_mapping [T] int64, once computed

    @staticmethod
    def build(batch: ForwardBatch, device: torch.device) -> "PackedPrefill":
        tok_slot: list[int] = []
        tok_pos: list[int] = []
        cu = [0]
        for slot, start, n in zip(batch.slots, batch.start_pos, batch.query_lens):
            tok_slot += [slot] * n
            tok_pos += range(start, start + n)
            cu.append(cu[-1] + n)
        T, N = len(tok_slot), batch.num_seqs
        # each per-sequence column padded to a multiple of 4 int32s: the kernel's pointers then stay 16-byte
        # aligned whatever N, and Triton, which specializes on alignment, compiles once (not on a request)
        n4 = -(-(N + 1) // 4) * 4
        cols = [c + [0] * (n4 - len(c)) for c in (batch.slots, batch.start_pos, cu)]
        flat = upload(tok_slot + tok_pos + cols[0] + cols[1] + cols[2], device)  # one copy, no sync
        seqs = flat[2 * T:].to(torch.int32)
        return PackedPrefill(flat[:T], flat[T:2 * T], seqs[:N], seqs[n4:n4 + N], seqs[2 * n4:2 * n4 + N + 1],
                             max(batch.query_lens))

    def slot_mapping(self, kv: KVCache) -> torch.Tensor:
        """[T] flat pool rows of the new tokens (computed once per forward from the device block table)."""
        if self.rows is None:
            self.rows = kv.slot_mapping(self.tok_slot, self.tok_pos)
        return self.rows
