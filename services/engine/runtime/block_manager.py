"""The paged KV cache's bookkeeping: which blocks of the pool each running request holds, and which
finished prompts' blocks are still worth keeping (the prefix cache). Host-side only: the K/V tensors
live in ``KVCache`` (kv_cache.py), which reads this object's block table.

Legend: NB blocks in the pool · BS tokens per block · S request slots (rows of the block table) ·
MB most blocks of one request (ceil(max_seq_len / BS)).

- Block 0 is the null block: no request owns it; padding rows (CUDA-graph replays) read and write it.
- A request's slot is its row of the block table: position p lives in block ``table[slot, p // BS]`` at
  offset ``p % BS``. Blocks are taken as the request grows (``grow``) and given back when it ends (``free``);
  nothing reserves --max-seq-len for a request.
- Prefix cache over blocks: a block full of computed tokens gets a key, the hash of its parent block's key
  and its own tokens, so equal keys mean equal token prefixes (the tokens themselves are part of the key,
  so a hash collision cannot serve another prompt's K/V). A new request takes the longest run of keyed
  blocks matching its prompt (``admit``: shared, reference-counted, never written again: a request only
  appends to blocks of its own). A block whose last holder ends stays keyed, evictable, least recently
  freed first; an unkeyed free block is always taken before an evictable one.
- The last prompt token is always computed (its logits give the first token), so a hit stops one block
  short when the whole prompt is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

NULL_BLOCK = 0


class BlockManager:
    """Blocks of a pool of ``num_blocks`` (block 0 the null block) for ``num_slots`` request slots."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_seq_len: int,
                 prefix_cache: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks  # NB, the null block included
        self.block_size = block_size  # BS
        self.num_slots = num_slots  # S (the table has one more row: the padding rows' slot, all null)
        self.max_blocks = -(-max_seq_len // block_size)  # MB
        self.prefix_cache = prefix_cache
        self.free_blocks: list[int] = list(range(num_blocks - 1, 0, -1))  # unkeyed, popped from the end
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, oldest first
        self.refs = [0] * num_blocks
        self.key_of: dict[int, tuple] = {}  # block -> its key (full blocks of computed tokens)
        self.block_of: dict[tuple, int] = {}  # key -> block
        self.tables: dict[int, list[int]] = {}  # slot -> its blocks in position order
        # slot -> (how many of its leading blocks are keyed, the last one's key): where ``commit`` goes on
        self.keyed: dict[int, tuple[int, tuple | None]] = {}
        # [S + 1, MB] int32: what the kernels read (KVCache.load_tables copies it to the device when
        # ``version`` moved); row S is the padding slot's, all null
        self.host_table = torch.zeros((num_slots + 1, self.max_blocks), dtype=torch.int32)
        self.version = 0
        self.cols = 1  # columns of host_table any row uses (what a table upload must copy)

    # -- capacity --------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Blocks a request can ever get (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: unkeyed free ones and evictable keyed ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by running requests (vLLM's kv_cache_usage_perc counts these)."""
        return self.num_usable - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing(self, slot: int, num_tokens: int) -> int:
        """Blocks ``slot`` still needs to hold ``num_tokens`` positions."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(slot, ())))

    # -- a request's life ---------------------------------------------------------------------
    def match(self, tokens: list[int]) -> list[int]:
        """The keyed blocks holding the longest block-aligned prefix of ``tokens``, leaving at least the
        last token to compute."""
        if not self.prefix_cache:
            return []
        out, parent, bs = [], None, self.block_size
        for i in range((len(tokens) - 1) // bs):
            key = (hash(parent), tuple(tokens[i * bs:(i + 1) * bs]))
            block = self.block_of.get(key)
            if block is None:
                break
            out.append(block)
            parent = key
        return out

    def admit(self, slot: int, tokens: list[int]) -> int:
        """Start ``slot``'s table with the cached prefix of ``tokens``; returns the tokens it covers."""
        if slot in self.tables:
            raise RuntimeError(f"KV slot {slot} is already in use")
        hits = self.match(tokens)
        for b in hits:
            if self.refs[b] == 0:
                self.evictable.pop(b)
            self.refs[b] += 1
        self.tables[slot] = list(hits)
        self.keyed[slot] = (len(hits), self.key_of[hits[-1]] if hits else None)
        self._write_row(slot, 0)
        return len(hits) * self.block_size

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Give ``slot`` the blocks to hold ``num_tokens`` positions; False (nothing taken) when the pool
        has too few free blocks."""
        need = self.missing(slot, num_tokens)
        if need == 0:
            return True
        if need > self.num_free:
            return False
        table = self.tables[slot]
        start = len(table)
        for _ in range(need):
            table.append(self._take())
        self._write_row(slot, start)
        return True

    def commit(self, slot: int, num_computed: int, tokens: Callable[[int, int], list[int]]) -> None:
        """Key ``slot``'s blocks that its first ``num_computed`` tokens fill (``tokens(start, end)``: its
        tokens at those positions), so later requests with the same prefix can share them. O(1) until a
        block fills."""
        if not self.prefix_cache:
            return
        table, bs = self.tables[slot], self.block_size
        n, parent = self.keyed[slot]
        while (n + 1) * bs <= num_computed and n < len(table):
            key = (hash(parent), tuple(tokens(n * bs, (n + 1) * bs)))
            block = table[n]
            if key not in self.block_of:  # else an equal block exists already: this one stays unkeyed
                self.block_of[key] = block
                self.key_of[block] = key
            parent = key
            n += 1
        self.keyed[slot] = (n, parent)

    def free(self, slot: int) -> None:
        """Give back ``slot``'s blocks: keyed ones become evictable, the rest free. The tail goes first in
        the eviction order: a prefix is only found from its first block on, so evicting the head would make
        the rest unreachable."""
        table = self.tables.pop(slot, None)
        self.keyed.pop(slot, None)
        if table is None:
            return
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.evictable[b] = None
                else:
                    self.free_blocks.append(b)
        self.host_table[slot, :len(table)] = NULL_BLOCK
        self.version += 1

    def _take(self) -> int:
        if self.free_blocks:
            b = self.free_blocks.pop()
        else:  # evict the least recently freed keyed block
            b, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(b)]
        self.refs[b] = 1
        return b

    def _write_row(self, slot: int, start: int) -> None:
        table = self.tables[slot]
        if len(table) > start:
            self.host_table[slot, start:len(table)] = torch.tensor(table[start:], dtype=torch.int32)
            self.cols = max(self.cols, len(table))
            self.version += 1

    def stats(self) -> dict:
        return {"kv_blocks_total": self.num_usable, "kv_blocks_used": self.num_used,
                "kv_blocks_cached": len(self.evictable), "kv_block_size": self.block_size,
                "kv_usage": self.num_used / self.num_usable}
