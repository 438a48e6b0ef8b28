"""RadixCache: the deterministic contracts other code relies on (cache-hit accounting, splits,
extra keys, pages, eviction orders, locks, reset, errors). Property tests against a naive
reference are in test_radix_cache.py."""

import pytest
import torch

from helpers import all_nodes
from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
from radixray.scheduler.radix_cache import MatchResult, RadixCache, RadixKey, TreeNode


def cached(cache, tokens, extra=None):
    return len(cache.match_prefix(RadixKey(tokens, extra)).indices)


def put(cache, tokens, extra=None, **kw):
    value = cache.allocator.alloc(len(tokens))
    got = cache.insert(RadixKey(tokens, extra), value, **kw)
    cache.allocator.free(value[:got])
    return got


def test_cache_hit_contract_tree_part():
    # SGLang's end-to-end test; the scheduler matches all but the last prompt token.
    cache = RadixCache()
    seq = lambda n: list(range(n))
    assert cached(cache, seq(100)[:-1]) == 0
    assert put(cache, seq(100)) == 0
    assert cached(cache, seq(10000)[:-1]) == 100
    assert put(cache, seq(10000)) == 100
    assert cached(cache, seq(10000)[:-1]) == 9999
    assert cached(cache, seq(1000)[:-1]) == 999
    assert cached(cache, seq(11000)[:-1]) == 10000
    assert cache.total_size() == 10000
    indices, node = cache.match_prefix(RadixKey(seq(10000)))
    assert len(indices) == 10000 and len(set(indices.tolist())) == 10000
    assert isinstance(node, TreeNode) and node.key.token_ids[-1] == 9999


def test_galloping_finds_every_first_mismatch():
    base = list(range(1000, 1300))
    cache = RadixCache()
    put(cache, base)
    for pos in list(range(0, 40)) + [63, 64, 65, 127, 128, 200, 255, 256, 298, 299]:
        probe = base.copy()
        probe[pos] = -1
        fresh = RadixCache()
        put(fresh, base)
        assert cached(fresh, probe) == pos
        assert cached(cache, base[:pos] + [7]) == pos


def test_split_keeps_total_size_values_and_locks():
    cache = RadixCache()
    value = cache.allocator.alloc(10)
    cache.insert(RadixKey(list(range(10))), value)
    locked = cache.match_prefix(RadixKey(list(range(10)))).last_node
    cache.inc_lock_ref(locked)
    indices, node = cache.match_prefix(RadixKey(list(range(4)) + [99]))
    assert indices.tolist() == value[:4].tolist()
    assert cache.total_size() == 10 and len(all_nodes(cache)) == 3
    assert len(node.key) == 4 and next(iter(node.children.values())) is locked
    assert len(locked.key) == 6 and node.lock_ref == locked.lock_ref == 1
    assert cache.protected_size() == 10 and cache.evictable_size() == 0
    assert cache.match_prefix(RadixKey(list(range(10)))).indices.tolist() == value.tolist()
    cache.dec_lock_ref(locked)
    assert node.lock_ref == 0 and cache.evictable_size() == 10


def test_extra_key_isolation():
    cache = RadixCache()
    assert put(cache, [1, 2, 3], "lora-a") == 0
    assert cached(cache, [1, 2, 3]) == 0
    assert cached(cache, [1, 2, 3], "lora-b") == 0
    assert cached(cache, [1, 2, 3], "lora-a") == 3
    assert put(cache, [1, 2, 3, 4], "lora-b") == 0
    assert put(cache, [1, 2, 3, 4]) == 0
    assert cache.total_size() == 11
    assert cached(cache, [1, 2, 3, 4], "lora-a") == 3


def test_page_rounding_with_real_allocator():
    alloc = TokenToKVPoolAllocator(64, page_size=4)
    cache = RadixCache(alloc, page_size=4)
    value = alloc.alloc(12)[:10]
    assert cache.insert(RadixKey(list(range(10))), value) == 0
    alloc.free(value[8:])  # the tail page the tree does not store
    assert cache.total_size() == 8 and alloc.available_size() == 64 - 8
    assert cached(cache, list(range(10))) == 8
    assert cached(cache, list(range(7))) == 4  # splits at a page boundary
    assert cached(cache, list(range(3))) == 0  # shorter than a page
    assert cached(cache, [0, 1, 2, 3, 4, 5, 99, 7]) == 4
    assert all(len(n.key) % 4 == 0 for n in all_nodes(cache)[1:])
    assert cache.total_size() == 8
    assert cache.evict(1) == 4 and cache.evict(1) == 4  # whole pages, leaf first
    assert alloc.available_size() == 64


def test_page_size_must_match_allocator_and_be_positive():
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(TokenToKVPoolAllocator(64, page_size=4), page_size=1)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(eviction_policy="random")


def evict_order(cache):
    """First tokens of the root's children in the order evict(1) removes them (no matching,
    which would touch access times)."""
    firsts = lambda: {c.key.token_ids[0] for c in cache.root.children.values()}
    order = []
    while cache.evictable_size():
        before = firsts()
        cache.evict(1)
        order += sorted(before - firsts())
    return order


def three_leaves(policy):
    cache = RadixCache(eviction_policy=policy)
    for f in (1, 2, 3):
        put(cache, [f, 0])
    cached(cache, [1, 0])  # touch the oldest one
    return cache


@pytest.mark.parametrize("policy,order", [
    ("lru", [2, 3, 1]), ("mru", [1, 3, 2]), ("fifo", [1, 2, 3]), ("filo", [3, 2, 1]),
])
def test_time_based_policy_order(policy, order):
    assert evict_order(three_leaves(policy)) == order


def test_lfu_order_counts_hits_then_recency():
    cache = RadixCache(eviction_policy="lfu")
    for f, hits in ((1, 2), (2, 1), (3, 0), (4, 1)):
        for _ in range(hits + 1):
            put(cache, [f, 0])
    assert evict_order(cache) == [3, 2, 4, 1]


def test_priority_order_then_recency():
    cache = RadixCache(eviction_policy="priority")
    for f, prio in ((1, 5), (2, 1), (3, 3), (4, 1)):
        put(cache, [f, 0], priority=prio)
    assert evict_order(cache) == [2, 4, 3, 1]


def test_slru_protects_twice_hit_keys():
    cache = RadixCache(eviction_policy="slru")
    for _ in range(3):
        put(cache, [1, 0])  # hit twice: protected, though least recently used
    put(cache, [3, 0])
    for _ in range(2):
        put(cache, [2, 0])  # hit once: still probationary
    cached(cache, [3, 0])
    assert [n.hit_count for n in sorted(all_nodes(cache)[1:], key=lambda n: n.key[0])] == [2, 1, 0]
    assert evict_order(cache) == [2, 3, 1]  # lru would give 1, 2, 3; lfu 3, 2, 1


def test_chunk_insert_does_not_bump_hits():
    cache = RadixCache()
    put(cache, [5, 6, 7])
    put(cache, [5, 6, 7, 8], is_chunk=True)
    assert cache.match_prefix(RadixKey([5, 6, 7])).last_node.hit_count == 0
    put(cache, [5, 6, 7, 8])
    assert cache.match_prefix(RadixKey([5, 6, 7])).last_node.hit_count == 1


def test_a_leaf_restamped_without_rescore_is_still_evicted():
    """Every entry of a leaf whose access time changed without ``rescore`` is stale: pop found
    the heap empty while the set still held the leaf and raised IndexError mid-step."""
    cache = RadixCache()
    put(cache, [1, 2])
    leaf = cache.match_prefix(RadixKey([1, 2])).last_node
    leaf.last_access_time += 1000  # a caller that forgot rescore
    assert cache.evict(2) == 2 and cache.total_size() == 0


def test_locked_nodes_survive_eviction():
    cache = RadixCache()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 9])
    put(cache, [7, 7])
    node = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    assert cache.inc_lock_ref(node) == 4
    assert cache.protected_size() == 4 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert cached(cache, [1, 2, 3, 4]) == 4 and cache.evict(100) == 0
    assert cache.dec_lock_ref(node) == 4
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(node)
    assert cache.evict(4) == 4 and cache.total_size() == 0
    assert cache.allocator.live == set()
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(node)


def test_disabled_cache_matches_nothing_and_frees_on_insert():
    cache = RadixCache(disable=True)
    value = cache.allocator.alloc(5)
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), value, is_chunk=True) == 0
    assert len(cache.allocator.live) == 5  # the running request still uses its slots
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), value) == 0
    assert cache.allocator.live == set()
    result = cache.match_prefix(RadixKey([1, 2, 3]))
    assert isinstance(result, MatchResult) and len(result.indices) == 0
    assert result.last_node is cache.root and cache.total_size() == 0


def test_reset_frees_everything_and_refuses_while_locked():
    cache = RadixCache()
    put(cache, [1, 2, 3])
    node = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and cache.allocator.live == set()
    assert cached(cache, [1, 2, 3]) == 0


def test_bad_input_names_the_field():
    cache = RadixCache()
    with pytest.raises(ValueError, match="value"):
        cache.insert(RadixKey([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="token_ids"):
        RadixKey([1, 2.5])
    with pytest.raises(ValueError, match="extra_key"):
        RadixKey([1], extra_key=["unhashable"])
    with pytest.raises(TypeError, match="key"):
        cache.match_prefix([1, 2])


def test_radix_key_slicing_and_pretty_print(capsys):
    key = RadixKey(torch.tensor([4, 5, 6, 7]), extra_key="salt")
    assert len(key) == 4 and key[1] == 5
    part = key[1:3]
    assert part.token_ids == [5, 6] and part.extra_key == "salt" and len(part) == 2
    assert key.packed[4:12] == part.packed
    cache = RadixCache()
    put(cache, [4, 5, 6], "salt")
    text = cache.pretty_print()
    assert "[4, 5, 6]" in text and "salt" in text and text in capsys.readouterr().out
