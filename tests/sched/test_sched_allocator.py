"""BlockAllocator and PrefixIndex on their own."""

import pytest

from mstar_actors.sched import BlockAllocator, PrefixIndex, chain_hash, root_hash


def make_allocator(num_blocks: int = 4) -> BlockAllocator:
    return BlockAllocator(num_blocks, block_size=4)


def test_allocate_free_accounting():
    alloc = make_allocator()
    blocks = alloc.allocate(3)
    assert len(set(blocks)) == 3 and alloc.num_used == 3 and alloc.num_free == 1
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(RuntimeError, match="can_allocate"):
        alloc.allocate(2)
    alloc.free(blocks)
    assert alloc.num_used == 0 and alloc.num_free == 4


def test_share_counts_holders_and_double_free_raises():
    alloc = make_allocator()
    [block] = alloc.allocate(1)
    alloc.share([block])
    assert alloc.ref_count(block) == 2
    alloc.free([block])
    assert alloc.ref_count(block) == 1 and alloc.num_used == 1
    alloc.free([block])
    assert alloc.num_used == 0
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([block])


def test_cached_block_stays_reusable_until_free_list_is_empty():
    alloc = make_allocator(num_blocks=3)
    a, b, c = alloc.allocate(3)
    assert alloc.cache(a, b"h-a" * 8)
    alloc.free([a, b, c])
    assert alloc.num_free == 3 and alloc.num_cached_free == 1
    # The two plain free blocks go first; the cached one survives.
    assert sorted(alloc.allocate(2)) == sorted([b, c])
    assert alloc.prefix_index.get(b"h-a" * 8) == a
    # Now only the cached one is left: it is evicted and its entry dropped.
    assert alloc.allocate(1) == [a]
    assert b"h-a" * 8 not in alloc.prefix_index and alloc.hash_of(a) is None


def test_eviction_is_least_recently_freed_first():
    alloc = make_allocator(num_blocks=3)
    blocks = alloc.allocate(3)
    for i, block in enumerate(blocks):
        alloc.cache(block, bytes([i]) * 32)
    alloc.free([blocks[1]])
    alloc.free([blocks[2]])
    alloc.free([blocks[0]])
    assert alloc.cached_free_ids() == [blocks[1], blocks[2], blocks[0]]
    alloc.share([blocks[2]])  # a prefix hit revives it
    assert alloc.allocate(1) == [blocks[1]]
    assert alloc.allocate(1) == [blocks[0]]
    assert not alloc.can_allocate(1)


def test_free_releases_a_table_tail_first():
    alloc = make_allocator(num_blocks=2)
    blocks = alloc.allocate(2)
    for i, block in enumerate(blocks):
        alloc.cache(block, bytes([i]) * 32)
    alloc.free(blocks)
    # The tail block is useless without the head: it goes first.
    assert alloc.cached_free_ids() == [blocks[1], blocks[0]]


def test_cache_refuses_a_second_block_with_the_same_hash():
    alloc = make_allocator()
    a, b = alloc.allocate(2)
    assert alloc.cache(a, b"x" * 32)
    assert not alloc.cache(b, b"x" * 32)
    alloc.free([a, b])
    assert alloc.num_cached_free == 1 and alloc.hash_of(b) is None


def test_share_of_a_plain_free_block_raises():
    alloc = make_allocator()
    with pytest.raises(RuntimeError, match="holds no cached prefix"):
        alloc.share([0])


def test_hash_chain_is_stable_and_depends_on_root_and_prefix():
    base = root_hash("model-a")
    assert base == root_hash("model-a") and len(base) == 32
    assert base != root_hash("model-b")
    h1 = chain_hash(base, [1, 2, 3, 4])
    assert h1 == chain_hash(root_hash("model-a"), (1, 2, 3, 4))
    assert h1 != chain_hash(root_hash("model-b"), [1, 2, 3, 4])
    assert h1 != chain_hash(base, [1, 2, 3, 5])
    assert chain_hash(h1, [5]) != chain_hash(base, [5])
    # Known value: the hash must not change between runs or processes.
    known = "4b2dc29e56b4bd6405b0ae1e8e9139f8933811823792cd068d4b858a96444924"
    assert chain_hash(root_hash("m"), [1, 2, 300000]).hex() == known


def test_prefix_index_lookup_longest_prefix():
    index = PrefixIndex()
    assert index.insert(b"a", 5) and index.insert(b"b", 7)
    assert not index.insert(b"a", 9)
    assert index.lookup([b"a", b"b", b"c", b"d"]) == [5, 7]
    assert index.lookup([b"b"]) == [7]
    assert index.lookup([b"c", b"a"]) == []
    index.remove(b"a")
    assert index.lookup([b"a", b"b"]) == [] and len(index) == 1
