"""Every KV slot changes hands here: between the free list, the radix tree and live requests.

``CacheManager`` owns the three ledgers of token memory on the scheduler's side:

- ``rows``: the request-to-token table (one row per live request, slots in position order);
- ``allocator``: the free list of KV slots;
- ``tree``: the radix cache, which owns the slots of every cached prefix.

A slot is always in exactly one place: free, in the tree, or held by one live request as part
of ``row[tree_len:cached_len]`` (see ``request.py`` for the length words), or (hierarchical
cache) by a pending load. ``check_invariant`` verifies that they add up to the pool size.

The lifecycle of a request's slots:

1. ``match``: find the cached prefix (``prefix_indices``, ``last_node``); nothing is locked yet.
2. ``lock`` (by the prefill adder) so eviction cannot take the prefix, then ``assign_row``.
3. ``alloc_extend`` before each forward: fresh slots for the tokens it computes, written into
   the row (cached prefix slots come first).
4. ``cache_unfinished`` after a prefill or a chunk: the computed prompt goes into the tree so
   other requests can hit it; the request's row now points at the tree's slots.
5. ``cache_finished`` when done: the whole sequence goes into the tree, the lock is dropped.
   Or ``release`` on retraction: own slots freed, nothing inserted.

With a host pool (``host_pool_size > 0``, the hierarchical cache) the tree is a
``HiRadixCache``: ``match`` also finds the host-only continuation of the prefix and
``start_load`` brings it back into device slots; the request waits until the batch carrying
the copy has come back (``ack_kv_copies``), then matches it on the device. Every batch takes
the queued tier copies (``take_kv_copies``). Pending loads hold device slots outside the tree
(``loading_size``), and the host tier has its own ledger: host free + host cached == host pool.
"""

from __future__ import annotations

import torch

from .hicache import HiRadixCache
from .memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from .radix_cache import RadixCache, RadixKey
from .request import Req


class CacheManager:
    def __init__(self, pool_size: int, max_running_requests: int, max_context_len: int,
                 page_size: int = 1, eviction_policy: str = "lru", disable: bool = False,
                 host_pool_size: int = 0, write_policy: str = "write_through"):
        self.page_size = page_size
        self.disabled = disable
        self.rows = ReqToTokenPool(max_running_requests, max_context_len)
        self.allocator = TokenToKVPoolAllocator(pool_size, page_size)
        self.hicache: HiRadixCache | None = None  # the same object as tree, when on
        if host_pool_size >= page_size and not disable:
            self.hicache = HiRadixCache(self.allocator,
                                        TokenToKVPoolAllocator(host_pool_size, page_size),
                                        page_size, eviction_policy, write_policy)
        self.tree = self.hicache or RadixCache(self.allocator, page_size, eviction_policy,
                                               disable)
        self.evicted_tokens = 0  # running total, for metrics

    # ------------------------------------------------------------------ budget views
    @property
    def pool_size(self) -> int:
        return self.allocator.size

    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def available_and_evictable(self) -> int:
        """Slots a new allocation can get: free ones plus unlocked cache it may evict."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def free_rows(self) -> int:
        return self.rows.available_size()

    def slots_needed(self, cached_len: int, extend_len: int) -> int:
        """Slots (in whole pages) that appending ``extend_len`` tokens after ``cached_len``
        takes; the free tail of the last page is used first."""
        p = self.page_size
        if p == 1:
            return extend_len
        in_last_page = (-cached_len) % p
        return -(-max(extend_len - in_last_page, 0) // p) * p

    # ------------------------------------------------------------------ matching and locks
    def key(self, req: Req, length: int) -> RadixKey:
        return RadixKey(req.tokens(0, length), req.extra_key)

    def match(self, req: Req) -> int:
        """Point ``req.prefix_indices`` / ``req.last_node`` at its longest usable cached prefix
        and return its length. Locks nothing: call ``lock`` before anything can evict.
        With the host tier, ``req.host_nodes`` continue the prefix on the host (their tokens
        count in the returned length; ``start_load`` loads them), and ``req.loaded_len`` says
        how much of the device prefix a load of this request brought back.

        Only for a request that holds no slots (new, or retracted)."""
        assert req.req_pool_idx is None, f"{req!r} already holds slots"
        result, req.host_nodes = self.tree.match_tiers(req.match_key())
        req.prefix_indices, req.last_node = result.indices, result.last_node
        start, end = req.load_range or (0, 0)
        req.loaded_len = max(min(end, req.tree_len) - start, 0)
        return len(result.indices) + sum(len(n.key) for n in req.host_nodes)

    def start_load(self, req: Req, room: float) -> bool:
        """Start loading the host-tier part of ``req``'s match (``req.host_nodes``) back to the
        device, or join the load already bringing it; True if ``req`` must now wait for
        ``req.load`` to be done (then match again). False when there is nothing to load, when
        the load plus the matched device prefix it locks (where still unlocked) would take
        more than ``room`` free or evictable slots, or when the pool is short: ``lock`` then
        leaves those tokens to be computed.

        Mutates: the tree and device allocator (``HiRadixCache.start_load``), ``req.load``,
        ``req.load_range``, ``req.host_nodes`` (cleared)."""
        nodes, req.host_nodes = req.host_nodes, []
        node, takes = req.last_node, sum(len(n.key) for n in nodes)
        while node is not self.tree.root and node.lock_ref == 0:  # ancestors of a lock are locked
            takes += len(node.key)
            node = node.parent
        job = self.tree.start_load(nodes) if takes <= room else None
        if job is None:
            return False
        req.load = job
        # a second load (after one this request waited for) keeps the first one's start
        start = req.tree_len if req.load_range is None else min(req.load_range[0], req.tree_len)
        req.load_range = (start, req.tree_len + sum(len(n.key) for n in nodes))
        return True

    def lock(self, req: Req) -> None:
        """Protect ``req``'s matched device prefix from eviction (moves it out of evictable).
        Host-tier tokens not loaded by now (``req.host_nodes``) are computed."""
        self.tree.inc_lock_ref(req.last_node)
        req.host_nodes = []

    def unlock(self, req: Req) -> None:
        self.tree.dec_lock_ref(req.last_node)

    # ------------------------------------------------------------------ allocation
    def assign_row(self, req: Req) -> None:
        """Give a matched, locked ``req`` a table row holding its cached prefix; from now on
        ``req.cached_len`` tokens need no compute."""
        row = self.rows.alloc()
        if row is None:
            raise RuntimeError("no free request row; the scheduler admits at most "
                               "max_running_requests requests")
        self.rows.write(row, 0, req.prefix_indices)
        req.req_pool_idx = row
        req.cached_len = req.tree_len
        req.load_range = None  # counted (``loaded_len``) by the match that admitted it

    def evict_for(self, num_slots: int) -> None:
        """Make at least ``num_slots`` slots free by evicting unlocked cache, if needed."""
        short = num_slots - self.allocator.available_size()
        if short > 0:
            self.evicted_tokens += self.tree.evict(short)

    def alloc_extend(self, reqs: list[Req]) -> torch.Tensor:
        """Slots for every request's ``extend_len`` new tokens, concatenated in batch order,
        and written into each row at ``[cached_len, seq_len)``. Evicts cache when short.

        The caller (the prefill adder or the decode check) has made sure they fit."""
        need = sum(self.slots_needed(r.cached_len, r.extend_len) for r in reqs)
        self.evict_for(need)
        if self.page_size == 1:
            slots = self.allocator.alloc(need)
        else:
            cached = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
            rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
            last = torch.where(cached > 0, self.rows.req_to_token[
                rows, (cached - 1).clamp(min=0)].to(torch.int64), 0)  # each one's last slot
            slots = self.allocator.alloc_extend(cached, [r.extend_len for r in reqs], last)
        if slots is None:
            raise RuntimeError(f"KV pool exhausted: {need} slots needed, "
                               f"{self.available_and_evictable()} free or evictable")
        table = self.rows.req_to_token
        if all(r.extend_len == 1 for r in reqs):  # decode: one vectorised write
            rows = torch.tensor([r.req_pool_idx for r in reqs])
            cols = torch.tensor([r.cached_len for r in reqs])
            table[rows, cols] = slots.to(table.dtype)
        else:
            offset = 0
            for r in reqs:
                self.rows.write(r.req_pool_idx, r.cached_len, slots[offset : offset + r.extend_len])
                offset += r.extend_len
        return slots

    def take_kv_copies(self):
        """The host<->device copies queued since the last batch, for the batch being built:
        ``(kv_store, kv_load, ticket)``: the first two as ``ForwardBatch`` takes them, the
        ticket for ``ack_kv_copies``. Clears the queue."""
        return self.tree.take_copies()

    def has_queued_copies(self) -> bool:
        return self.tree.has_queued_copies()

    def ack_kv_copies(self, ticket, stores_ok: bool, loads_ok: bool) -> None:
        """Settle the copies of a batch whose output is back (``HiRadixCache.ack_copies``):
        failed stores drop host copies; loads join the tree, or free their slots and drop
        their host copies when they (or a store they read) failed."""
        self.tree.ack_copies(ticket, stores_ok, loads_ok)

    # ------------------------------------------------------------------ hand-over
    def _slots(self, req: Req) -> torch.Tensor:
        return self.rows.read(req.req_pool_idx, req.cached_len)

    def cache_unfinished(self, req: Req) -> None:
        """Insert ``req``'s computed tokens into the tree mid-flight (after a prefill or a
        chunk), so other requests can reuse them now.

        Mutates: the tree (insert; chunk inserts leave hit counts alone), the allocator (our
        copies of tokens the tree already had are freed), ``req``'s row (points at the tree's
        slots), ``prefix_indices``/``last_node`` and the lock (moved to the new last node).
        A partial last page stays with the request.

        When the tree already had some of these tokens (another request computed them in the
        meantime), the row changes under the worker's mirror of it; ``req.resend_prefix`` makes
        the next batch carry the whole prefix again."""
        n = req.known_cached_len
        slots, key = self._slots(req)[:n], self.key(req, n)
        already = self.tree.insert(key, slots, is_chunk=True)
        if already > req.tree_len:
            self.allocator.free(slots[req.tree_len : already])
            req.resend_prefix = True
        result = self.tree.match_prefix(key)
        self.rows.write(req.req_pool_idx, 0, result.indices)
        self.tree.inc_lock_ref(result.last_node)  # lock the new path before unlocking the old
        self.tree.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = result.indices, result.last_node

    def cache_finished(self, req: Req) -> None:
        """``req`` is done: its KV goes into the tree (the tree keeps one copy of each prefix;
        our duplicates and the partial last page are freed), its lock and row are released.

        Mutates: tree, allocator, row pool; resets ``req``'s KV state. With the cache disabled
        the tree frees the slots instead of keeping them."""
        n = req.known_cached_len
        slots = self._slots(req)  # may run past n: those slots are ours and freed below
        aligned = n - n % self.page_size
        already = self.tree.insert(self.key(req, n), slots[:n])
        self.allocator.free(slots[req.tree_len : already])
        self.allocator.free(slots[aligned:])
        self._drop(req)

    def release(self, req: Req) -> None:
        """Free everything ``req`` holds without caching it (retraction): its own slots, its
        lock, its row. The prefix it shared with the tree stays cached (now unlocked)."""
        self.allocator.free(self.rows.read(req.req_pool_idx, req.cached_len, start=req.tree_len))
        self._drop(req)

    def _drop(self, req: Req) -> None:
        self.tree.dec_lock_ref(req.last_node)
        self.rows.free(req.req_pool_idx)
        req.reset_kv_state()

    def flush(self) -> None:
        """Empty the cache and reset the ledgers. Only when no request holds slots."""
        self.tree.reset()
        self.allocator.clear()
        self.rows.clear()

    # ------------------------------------------------------------------ debugging
    def owned_slots(self, req: Req) -> int:
        """Slots ``req`` holds alone (whole pages): ``row[tree_len:cached_len]``."""
        p = self.page_size
        return (-(-req.cached_len // p) - req.tree_len // p) * p

    def check_invariant(self, live: list[Req]) -> None:
        """Raise AssertionError unless free + tree + held-by-live-requests + pending loads ==
        pool size, the tree's sizes agree, every live row starts with its tree prefix, and no
        lock outlives its request."""
        holders = [r for r in live if r.req_pool_idx is not None]
        free, in_tree = self.allocator.available_size(), self.tree.total_size()
        held = sum(self.owned_slots(r) for r in holders)
        loading = self.tree.loading_size()  # pending host->device loads, outside the tree
        assert free + in_tree + held + loading == self.pool_size, (
            f"slot leak: free {free} + tree {in_tree} + held {held} + loading {loading} "
            f"!= pool {self.pool_size}")
        assert self.tree.evictable_size() + self.tree.protected_size() == in_tree
        assert self.rows.available_size() + len(holders) == self.rows.size, "request row leak"
        for r in holders:
            row = self.rows.read(r.req_pool_idx, r.tree_len)
            assert torch.equal(row, r.prefix_indices.to(row.dtype)), f"{r!r}: row != prefix"
        if not holders and not loading:  # a pending load locks the node above its path
            assert self.tree.protected_size() == 0, "a lock outlived its request"
        self.tree.check_tiers()
