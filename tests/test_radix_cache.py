"""RadixCache: property tests against a naive reference, plus the contracts other code relies on."""

import heapq

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from radixray.scheduler.eviction_policy import POLICIES
from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
from radixray.scheduler.radix_cache import MatchResult, RadixCache, RadixKey, TreeNode


class RecordingAllocator:
    """Wraps an allocator; tracks live pages so leaks and double frees are visible."""

    def __init__(self, inner, page_size):
        self.inner, self.page_size = inner, page_size
        self.live_pages: set[int] = set()
        self.freed_log: list[int] = []

    def available_size(self):
        return self.inner.available_size()

    def alloc(self, n):
        slots = self.inner.alloc(-(-n // self.page_size) * self.page_size)
        if slots is None:
            return None
        pages = {s // self.page_size for s in slots.tolist()}
        assert not pages & self.live_pages, "allocator handed out a live page"
        self.live_pages |= pages
        return slots[:n]

    def free(self, slots):
        if len(slots) == 0:
            return
        pages = {s // self.page_size for s in slots.tolist()}
        assert pages <= self.live_pages, f"double free of pages {pages - self.live_pages}"
        self.live_pages -= pages
        self.freed_log.extend(slots.tolist())
        self.inner.free(slots)


def tree_entries(cache):
    """{(extra_key, token prefix): slots of its last page} for every page held by the tree."""
    out, stack, p = {}, [(cache.root, ())], cache.page_size
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            toks, slots = child.key.token_ids, child.value.tolist()
            for i in range(0, len(toks), p):
                out[(child.key.extra_key, prefix + tuple(toks[: i + p]))] = tuple(slots[i : i + p])
            stack.append((child, prefix + tuple(toks)))
    return out


def all_nodes(cache):
    stack, out = [cache.root], []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


# Prompts share prefixes in practice: a slice of one of a few "system prompts" plus a random
# tail, so edges are shared, split at every depth, and locked paths get split later.
_BASES = [[0, 1, 2, 3] * 4, [0, 1, 2, 3, 0, 1, 2, 3, 3, 2, 1, 0, 3, 2, 1, 0], [2] * 16]
token_lists = st.builds(lambda b, n, tail: _BASES[b][:n] + tail, st.integers(0, 2),
                        st.integers(0, 16), st.lists(st.integers(0, 3), max_size=6))


class CacheMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against a reference: a dict from every
    cached (extra_key, page-aligned prefix) to the slots of the prefix's last page."""

    page_size = 1
    real_allocator = False

    @initialize(policy=st.sampled_from(sorted(POLICIES)))
    def setup(self, policy):
        p = self.page_size
        inner = (TokenToKVPoolAllocator(48 * p, p) if self.real_allocator
                 else RadixCache(page_size=p).allocator)
        self.alloc = RecordingAllocator(inner, p)
        self.cache = RadixCache(self.alloc, page_size=p, eviction_policy=policy)
        self.ref: dict = {}
        self.locks: list = []  # (node, extra, matched tokens)

    def ref_match(self, extra, tokens):
        out = []
        for i in range(self.page_size, len(tokens) + 1, self.page_size):
            slots = self.ref.get((extra, tuple(tokens[:i])))
            if slots is None:
                break
            out += slots
        return out

    def expected_evictions(self, n):
        """Slots evict(n) should free: the policy's order over a heap of unlocked leaves rebuilt
        from scratch (the cache keeps its heap across calls; this checks it stays exact)."""
        score, root = POLICIES[self.cache.eviction_policy], self.cache.root
        heap = [(score(x), x.id, x) for x in all_nodes(self.cache)[1:]
                if not x.children and x.lock_ref == 0]
        heapq.heapify(heap)
        gone, slots = set(), []
        while len(slots) < n and heap:
            _, _, node = heapq.heappop(heap)
            gone.add(node)
            slots += node.value.tolist()
            parent = node.parent
            orphaned = set(parent.children.values()) <= gone
            if parent is not root and parent.lock_ref == 0 and orphaned:
                heapq.heappush(heap, (score(parent), parent.id, parent))
        return set(slots)

    def evict(self, n):
        before, protected = self.cache.evictable_size(), self.cache.protected_size()
        expected = self.expected_evictions(n)
        self.alloc.freed_log.clear()
        got = self.cache.evict(n)
        freed = set(self.alloc.freed_log)
        assert freed == expected, "evicted in a different order than the policy's"
        assert got == len(self.alloc.freed_log) == len(freed)
        assert got >= n if before >= n else got == before
        assert self.cache.protected_size() == protected
        p = self.page_size
        removed = [k for k, s in self.ref.items() if freed & set(s)]
        assert sum(len(self.ref[k]) for k in removed) == len(freed), "freed a slot not cached"
        for key in removed:
            del self.ref[key]
        for extra, prefix in self.ref:  # leaves go first, so what is left is prefix-closed
            assert len(prefix) == p or (extra, prefix[:-p]) in self.ref
        for _, extra, toks in self.locks:
            assert all((extra, tuple(toks[:i])) in self.ref for i in range(p, len(toks) + 1, p))

    @rule(tokens=token_lists, extra=st.sampled_from([None, "a"]), reuse=st.booleans(),
          is_chunk=st.booleans())
    def insert(self, tokens, extra, reuse, is_chunk):
        key = RadixKey(tokens, extra)
        if reuse:  # the request computes only what the cache lacks
            prefix, node = self.cache.match_prefix(key)
        else:  # it computed everything (e.g. matched before another request inserted)
            prefix, node = torch.empty(0, dtype=torch.int64), self.cache.root
        self.cache.inc_lock_ref(node)  # as a request does while it allocates
        need = len(tokens) - len(prefix)
        fresh = self.alloc.alloc(need)
        if fresh is None:
            self.evict(-(-need // self.page_size) * self.page_size - self.alloc.available_size())
            fresh = self.alloc.alloc(need)
        if fresh is not None:
            value = torch.cat([prefix, fresh])
            expected = len(self.ref_match(extra, tokens))
            hits_before = {n: n.hit_count for n in all_nodes(self.cache)}
            got = self.cache.insert(key, value, is_chunk=is_chunk)
            assert got == expected
            aligned = len(tokens) - len(tokens) % self.page_size
            for i in range(got, aligned, self.page_size):
                self.ref[(extra, tuple(tokens[: i + self.page_size]))] = tuple(
                    value[i : i + self.page_size].tolist())
            self.alloc.free(value[len(prefix) : got])  # our duplicates of cached tokens
            self.alloc.free(value[aligned:])  # the partial page the tree does not store
            if is_chunk:
                assert all(n.hit_count == hits for n, hits in hits_before.items())
        self.cache.dec_lock_ref(node)

    @rule(tokens=token_lists, extra=st.sampled_from([None, "a"]), lock=st.booleans())
    def match(self, tokens, extra, lock):
        indices, node = self.cache.match_prefix(RadixKey(tokens, extra))
        assert indices.dtype == torch.int64 and indices.tolist() == self.ref_match(extra, tokens)
        path, n = [], node
        while n is not self.cache.root:
            path = n.key.token_ids + path
            n = n.parent
        assert path == tokens[: len(indices)]
        if lock:
            self.cache.inc_lock_ref(node)
            self.locks.append((node, extra, tokens[: len(indices)]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 20))
    def evict_rule(self, n):
        self.evict(n)

    @invariant()
    def consistent(self):
        cache, p = self.cache, self.page_size
        assert tree_entries(cache) == self.ref
        expected_locks = {}
        for node, _, _ in self.locks:
            while node is not cache.root:
                expected_locks[node] = expected_locks.get(node, 0) + 1
                node = node.parent
        slots, sizes, leaves = [], [0, 0], set()
        for node in all_nodes(cache)[1:]:
            assert len(node.key) > 0 and len(node.key) == len(node.value)
            assert len(node.key) % p == 0
            assert node.parent.children[(node.key.extra_key, node.key.packed[: 4 * p])] is node
            firsts = [(c.key.extra_key, tuple(c.key.token_ids[:p])) for c in node.children.values()]
            assert len(firsts) == len(set(firsts))
            assert node.lock_ref == expected_locks.get(node, 0)
            slots += node.value.tolist()
            sizes[node.lock_ref > 0] += len(node.value)
            if not node.children and node.lock_ref == 0:
                leaves.add(node)
        assert len(slots) == len(set(slots)), "a slot is held twice"
        assert {s // p for s in slots} == self.alloc.live_pages, "leaked or lost a page"
        assert sizes == [cache.evictable_size(), cache.protected_size()]
        assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(slots)
        locked = {(e, tuple(t[:i])) for _, e, t in self.locks for i in range(p, len(t) + 1, p)}
        assert cache.protected_size() == len(locked) * p
        assert leaves == cache._evictable.leaves
        if self.real_allocator:
            assert self.alloc.available_size() + len(self.alloc.live_pages) * p == 48 * p


class PagedCacheMachine(CacheMachine):
    page_size = 2


class RealAllocatorPage4Machine(CacheMachine):
    page_size = 4
    real_allocator = True


_fast = settings(max_examples=80, stateful_step_count=50, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
TestCacheProperties = CacheMachine.TestCase
TestCacheProperties.settings = _fast
TestPagedCacheProperties = PagedCacheMachine.TestCase
TestPagedCacheProperties.settings = _fast
TestRealAllocatorPage4Properties = RealAllocatorPage4Machine.TestCase
TestRealAllocatorPage4Properties.settings = _fast


# ---- deterministic contracts ----------------------------------------------------------------

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
