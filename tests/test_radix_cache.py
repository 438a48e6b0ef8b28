"""RadixCache: property tests (Hypothesis state machines) against a naive reference. The
contracts other code relies on are in test_radix_cache_contracts.py."""

import heapq

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from helpers import all_nodes
from radixray.scheduler.eviction_policy import POLICIES
from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
from radixray.scheduler.radix_cache import RadixCache, RadixKey


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
