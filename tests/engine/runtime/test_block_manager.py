"""The paged KV pool's bookkeeping alone (no model): blocks taken as a request grows and given back when
it ends, the block table the kernels read, prefix blocks shared by content with reference counts, keyed
blocks kept until the pool needs them (least recently freed evicted first), the null block never handed out."""

import pytest

from services.engine.runtime.block_manager import NULL_BLOCK, BlockManager

BS = 4


def tokens_of(seq):
    return lambda a, b: seq[a:b]


def test_grow_takes_blocks_as_needed_and_free_gives_them_back():
    m = BlockManager(num_blocks=6, block_size=BS, num_slots=2, max_seq_len=16)
    assert m.num_usable == 5 and m.num_free == 5
    assert m.admit(0, list(range(10))) == 0  # nothing cached yet
    assert m.grow(0, 5) and len(m.tables[0]) == 2 and m.num_used == 2
    assert m.grow(0, 8) and len(m.tables[0]) == 2  # still inside the second block
    assert m.grow(0, 9) and len(m.tables[0]) == 3
    assert NULL_BLOCK not in m.tables[0]
    row = m.host_table[0, :3].tolist()
    assert row == m.tables[0] and m.host_table[2].tolist() == [NULL_BLOCK] * 4  # the padding row
    v = m.version
    m.admit(1, [9])
    assert m.grow(1, 4) and not m.grow(1, 13)  # 3 + 1 taken, 1 left: 3 more do not fit, none taken
    assert len(m.tables[1]) == 1 and m.num_free == 1 and m.version > v
    m.free(0)
    assert m.num_free == 4 and m.host_table[0, :3].tolist() == [NULL_BLOCK] * 3
    assert m.stats()["kv_usage"] == pytest.approx(1 / 5)


def test_prefix_blocks_are_shared_by_content_and_stop_short_of_the_last_token():
    m = BlockManager(num_blocks=10, block_size=BS, num_slots=3, max_seq_len=32)
    a = list(range(100, 110))  # two full blocks + 2 tokens
    m.admit(0, a)
    m.grow(0, len(a))
    m.commit(0, len(a), tokens_of(a))  # the two full blocks get keys
    # same first block, different second: one block shared
    b = a[:4] + [7, 7, 7, 7, 1]
    assert m.admit(1, b) == 4 and m.tables[1][0] == m.tables[0][0] and m.refs[m.tables[0][0]] == 2
    # a prompt that is exactly a's two blocks: the last token must be computed, so only one block is a hit
    assert m.admit(2, a[:8]) == 4
    m.free(2)
    # a's blocks stay cached after it ends: a new request with a's prompt gets both back
    m.free(0)
    assert m.refs[m.tables[1][0]] == 1 and len(m.evictable) == 1  # block 0 still held by slot 1
    assert m.admit(0, a) == 8


def test_evictable_blocks_serve_growth_after_the_free_ones_oldest_first():
    m = BlockManager(num_blocks=5, block_size=BS, num_slots=2, max_seq_len=16)
    a, b = [1] * 4 + [2], [3] * 4 + [4]
    for slot, seq in ((0, a), (1, b)):
        m.admit(slot, seq)
        m.grow(slot, len(seq))
        m.commit(slot, len(seq), tokens_of(seq))
    m.free(0)  # a's keyed block is freed first, b's second
    m.free(1)
    assert m.num_free == 4 and len(m.evictable) == 2 and len(m.free_blocks) == 2
    m.admit(0, [9])
    assert m.grow(0, 12)  # 2 unkeyed blocks, then a's keyed one (the oldest) is evicted
    assert m.match(a) == [] and len(m.match(b)) == 1 and len(m.evictable) == 1


def test_a_pool_of_one_block_is_refused():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(num_blocks=1, block_size=BS, num_slots=1, max_seq_len=4)
