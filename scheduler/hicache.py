"""HiRadixCache: the radix tree over two tiers of KV memory, device (L1) and host (L2).

A node's KV may live in device slots (``value``), in host slots (``host_value``), or both.
The scheduler owns both slot tables (``allocator`` for the device pool, ``host_allocator`` for
the host pool); the K/V data lives in the worker, which copies it between the tiers when a
batch carries copy lists. Queuing those copies and settling them from the batch's output
(including copies that failed) is ``TierCopies``' job (``hicache_copies.py``).

Rules that keep the tiers consistent:

- Device-resident nodes are closed under "parent of": a path from the root is device nodes
  first, then host-only nodes. Device eviction takes only device leaves (no device children),
  and a load brings back the whole host-only part of a matched path at once.
- ``write_through``: a node gets its host copy when it is inserted. ``write_back``: when it is
  evicted from the device. A device-evicted node with a host copy stays in the tree with
  ``value = None``; without one (the host pool was full) it is removed with its subtree.
- Host eviction takes host-only leaves first (LRU, or the tree's policy) and removes them;
  when that is not enough, it drops the host copies of nodes that are on the device too
  (least recently used first), which stay in the tree on the device only. Nodes being loaded
  are pinned: neither touches them.
- Host-pool exhaustion or a failed copy only means fewer host copies: those prefixes are
  recomputed later.

Sizes: ``total_size``/``evictable_size``/``protected_size`` count device tokens in the tree (as
in ``RadixCache``); ``loading_size`` the device slots of loads not acknowledged yet;
``host_size`` tokens with a host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import WRITE_POLICIES
from .eviction_policy import EvictionQueue
from .hicache_copies import TierCopies
from .memory_pool import TokenToKVPoolAllocator
from .radix_cache import MatchResult, RadixCache, RadixKey, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class HiCacheStats:
    """Running totals (tests, the benchmark and metrics read them). Tokens unless noted."""

    stored: int = 0  # device -> host copies queued
    loaded: int = 0  # host -> device copies acknowledged and used
    host_evicted: int = 0  # host copies dropped to make room
    backup_failed: int = 0  # found the host pool full (recomputed if needed again)
    store_failures: int = 0  # batches whose stores failed on some rank (count)
    load_failures: int = 0  # batches whose loads failed on some rank (count)
    failed_tokens: int = 0  # host copies dropped because a copy failed
    failed_batches: int = 0  # batches with a failed store or load (count)
    load_evicted: int = 0  # device tokens evicted to make room for loads


# A host hit shorter than this is recomputed: its load would cost the request a batch of
# latency (it waits for the copy to be confirmed) for less work than a few tokens' prefill.
MIN_LOAD_TOKENS = 10


class HiRadixCache(TierCopies, RadixCache):
    def __init__(self, allocator, host_allocator: TokenToKVPoolAllocator, page_size: int = 1,
                 eviction_policy: str = "lru", write_policy: str = "write_through",
                 min_load_tokens: int = MIN_LOAD_TOKENS):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                             f"got {write_policy!r}")
        if host_allocator.page_size != page_size:
            raise ValueError("the host pool's page_size differs from the device pool's")
        self.host_allocator = host_allocator
        self.write_back = write_policy == "write_back"
        self.min_load_tokens = min_load_tokens
        self.stats = HiCacheStats()
        super().__init__(allocator, page_size, eviction_policy)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._host_size = 0
        # Host-only leaves (no children at all), in policy order: what host eviction takes.
        self._host_evictable = EvictionQueue(self.eviction_policy)
        self._init_copies()

    def host_size(self) -> int:
        """Tokens with a host copy (host slots held by the tree)."""
        return self._host_size

    # ---- lookup and insertion ----------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The device part of the longest cached prefix (see ``match_tiers``)."""
        return self.match_tiers(key)[0]

    def match_tiers(self, key: RadixKey) -> tuple[MatchResult, list[TreeNode]]:
        """Longest cached prefix over both tiers: (its device part, as ``match_prefix`` gives
        it, and the host-only nodes that continue it, in path order). Loads nothing; pass the
        nodes to ``start_load``.

        Mutates: access times on the path, maybe a split (sizes unchanged)."""
        self._check_key(key)
        n = len(key.token_ids) - len(key.token_ids) % self.page_size
        if n == 0:
            return MatchResult(_EMPTY, self.root), []
        _, _, path = self._walk(key, n, next(self._clock))
        for p in path:  # access times changed; device leaves may sit mid-path here
            self._evictable.rescore(p)
            self._host_evictable.rescore(p)
        k = next((i for i, p in enumerate(path) if p.value is None), len(path))
        device = path[:k]
        indices = _EMPTY if not device else (
            device[0].value if k == 1 else torch.cat([p.value for p in device]))
        return MatchResult(indices, device[-1] if device else self.root), path[k:]

    def insert(self, key: RadixKey, value, is_chunk: bool = False, priority: int = 0) -> int:
        """As ``RadixCache.insert``. Host-only nodes on the path take the caller's freshly
        computed slots (they are on both tiers afterwards), so the returned count, the prefix
        whose slots the caller must free as duplicates, stops at the first of them.
        Under write_through the new leaf's host copy is queued."""
        self._check_key(key)
        value = self._check_value(key, value)
        n = len(key) - len(key) % self.page_size
        first_adopted = self._adopt(key, value, n) if n else None
        matched = super().insert(key, value, is_chunk, priority)
        return matched if first_adopted is None else first_adopted

    def _adopt(self, key: RadixKey, value: torch.Tensor, n: int) -> int | None:
        """Give the host-only nodes on ``key[:n]``'s path device slots from ``value``; return
        the offset of the first one (None when there is none). A node being loaded may be
        adopted too: its load's slots are then surplus (``_finish_load``)."""
        _, _, path = self._walk(key, n, next(self._clock))
        offset, first, adopted = 0, None, []
        for p in path:
            size = len(p.key)
            if p.value is None:
                first = offset if first is None else first
                p.value = value[offset : offset + size].clone()
                self._host_evictable.discard(p)
                self._evictable.discard(p.parent)
                self._evictable_size += size
                adopted.append(p)
            offset += size
        if adopted and self._device_leaf(adopted[-1]):
            self._evictable.add(adopted[-1])
        return first

    def _on_new_leaf(self, leaf: TreeNode) -> None:
        if not self.write_back:
            self._backup(leaf)

    # ---- tier moves --------------------------------------------------------------------------

    def _backup(self, node: TreeNode) -> bool:
        """Give device node ``node`` a host copy (queue the store); False if the host pool is
        full even after host eviction."""
        size = len(node.key)
        if size > self.host_allocator.size:  # evicting everything would not make room
            self.stats.backup_failed += size
            return False
        short = size - self.host_allocator.available_size()
        if short > 0:
            short -= self._evict_host(short)
        if short > 0:
            # a batch at a time (an eighth of the pool), so the tree walk is rare
            self._drop_device_copies(max(short, self.host_allocator.size // 8))
        slots = self.host_allocator.alloc(size)
        if slots is None:
            self.stats.backup_failed += size
            return False
        self._queue_store(node, slots)
        return True

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots from unlocked device leaves in policy
        order (or all that are evictable); return how many. A node with a host copy (made now
        under write_back, if the host pool has room) stays in the tree on the host only; one
        without is removed with its host-only subtree.

        Mutates: nodes' ``value``, the tree, both allocators, sizes, queues, queued stores."""
        if num_tokens <= 0 or not self._evictable:
            return 0
        freed, released = 0, []
        while freed < num_tokens and self._evictable:
            node = self._evictable.pop()
            size = len(node.key)
            if node.host_value is None and self.write_back:
                self._backup(node)
            released.append(node.value)
            freed += size
            node.value = None
            parent = node.parent
            if node.host_value is not None:
                if not node.children and node not in self._load_of:
                    self._host_evictable.add(node)
            else:
                self._remove_subtree(node)
            if parent is not self.root and parent.lock_ref == 0 and self._device_leaf(parent):
                self._evictable.add(parent)
        self._evictable_size -= freed
        self.allocator.free(torch.cat(released))
        return freed

    def _evict_host(self, num_tokens: int) -> int:
        """Remove host-only leaves until ``num_tokens`` host slots are free (or none is left)."""
        freed, released = 0, []
        while freed < num_tokens and self._host_evictable:
            node = self._host_evictable.pop()
            freed += len(node.key)
            released.append(self._take_host_copy(node))
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            node.parent = None
            if (parent is not self.root and parent.value is None and not parent.children
                    and parent not in self._load_of):
                self._host_evictable.add(parent)
        return self._release_host(released, freed)

    def _drop_device_copies(self, num_tokens: int) -> int:
        """Free host slots by dropping the host copies of nodes that are on the device too,
        least recently used first, until ``num_tokens`` are free; return how many. Under
        write_through every cached node has such a copy, so without this a full host pool
        would keep old prefixes' copies and refuse new ones. Skips nodes with host-only
        children (they would be lost with the parent later) and nodes being loaded (their
        load reads the copy). The node stays in the tree on the device.

        Mutates: nodes' ``host_value``, the host allocator, ``host_size``, queued stores."""
        candidates, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if (node.value is not None and node.host_value is not None
                    and node not in self._load_of
                    and all(c.value is not None for c in node.children.values())):
                candidates.append(node)
        candidates.sort(key=lambda n: n.last_access_time)
        freed, released = 0, []
        for node in candidates:
            if freed >= num_tokens:
                break
            freed += len(node.key)
            released.append(self._take_host_copy(node))
        return self._release_host(released, freed)

    def _release_host(self, released: list[torch.Tensor], tokens: int) -> int:
        """Free detached host copies' slots; count ``tokens`` as host-evicted; return it."""
        if released:
            self.host_allocator.free(torch.cat(released))
        self.stats.host_evicted += tokens
        return tokens

    def _remove_subtree(self, node: TreeNode) -> None:
        """Take ``node`` (whose device slots the caller frees) out of the tree, freeing the host
        copies of its subtree (host-only nodes, by the closure rule) and its own, if any. The
        subtree holds no node being loaded: a load's parent is locked, so is every ancestor."""
        del node.parent.children[self._child_key(node.key)]
        node.parent = None
        stack, released = [node], []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._host_evictable.discard(n)
            if n.host_value is not None:
                released.append(self._take_host_copy(n))
        self._release_host(released, 0)

    def _device_leaf(self, node: TreeNode) -> bool:
        return all(c.value is None for c in node.children.values())

    def reset(self) -> None:
        """Empty both tiers (queued copies are dropped). Refused while a lock is held or a load
        is pending (the scheduler flushes only when idle, with no batch in flight)."""
        if self._protected_size or self._load_of:
            raise RuntimeError(f"reset: {self._protected_size} cached tokens are locked by "
                               f"running requests or pending loads")
        device, host, stack = [], [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.value is not None:
                device.append(node.value)
            if node.host_value is not None:
                host.append(node.host_value)
        if device:
            self.allocator.free(torch.cat(device))
        if host:
            self.host_allocator.free(torch.cat(host))
        self._init_tree()

    # ---- debugging ---------------------------------------------------------------------------

    def check_tiers(self) -> None:
        """Raise AssertionError unless every node has a copy somewhere, device nodes are
        closed under parent, host-only nodes are unlocked, loading nodes are pinned, the
        per-tier sizes add up, and host free + host cached == host pool."""
        device = host = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            size = len(node.key)
            assert node.value is not None or node.host_value is not None, f"{node!r}: no copy"
            for slots in (node.value, node.host_value):
                assert slots is None or len(slots) == size, f"{node!r}: slots != key length"
            if node.value is not None:
                device += size
                assert node.parent is self.root or node.parent.value is not None, \
                    f"{node!r}: on the device below a host-only parent"
            else:
                assert node.lock_ref == 0, f"{node!r}: a host-only node is locked"
            if node in self._load_of:
                assert node.host_value is not None and node not in self._host_evictable, \
                    f"{node!r}: a loading node without a pinned host copy"
            host += 0 if node.host_value is None else size
        for node in self._host_evictable.leaves:
            assert (node.parent is not None and node.value is None and not node.children
                    and node.host_value is not None), f"{node!r}: not a host-only leaf"
        jobs = {id(j): j for j in self._load_of.values()}.values()
        assert self._loading_size == sum(len(j.device_slots) for j in jobs), "loading size"
        assert device == self.total_size(), f"device tokens {device} != {self.total_size()}"
        assert host == self._host_size, f"host tokens {host} != {self._host_size}"
        free = self.host_allocator.available_size()
        assert free + host == self.host_allocator.size, (
            f"host slot leak: free {free} + cached {host} != pool {self.host_allocator.size}")
