"""Which unlocked leaf of the radix cache to evict first.

Each policy is one small function mapping a ``TreeNode`` to a sort key; ``EvictionQueue`` keeps
the unlocked leaves in a min-heap on ``(key, node.id)`` and hands out the smallest first. The
node id breaks ties, so equal keys go oldest node first and the order is deterministic. Times
are ticks of the cache's monotonic counter, so larger means later.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

# SLRU: a node reused this many times moves from the probationary to the protected segment.
SLRU_PROTECTED_HITS = 2


def lru(node) -> int:
    """Least recently used first."""
    return node.last_access_time


def mru(node) -> int:
    """Most recently used first."""
    return -node.last_access_time


def fifo(node) -> int:
    """Oldest inserted first, however often it is used."""
    return node.creation_time


def filo(node) -> int:
    """Newest inserted first."""
    return -node.creation_time


def lfu(node) -> tuple[int, int]:
    """Fewest hits first; among equal counts, least recently used first."""
    return node.hit_count, node.last_access_time


def priority(node) -> tuple[int, int]:
    """Lowest request priority first; among equal priorities, least recently used first."""
    return node.priority, node.last_access_time


def slru(node) -> tuple[bool, int]:
    """Segmented LRU: probationary nodes (hit fewer than twice) go first, in LRU order; protected
    ones only when no probationary leaf is left. One-off prompts thus cannot flush a prefix that
    many requests share."""
    return node.hit_count >= SLRU_PROTECTED_HITS, node.last_access_time


POLICIES: dict[str, Callable] = {
    "lru": lru, "lfu": lfu, "slru": slru, "priority": priority,
    "fifo": fifo, "filo": filo, "mru": mru,
}


def get_policy(name: str) -> Callable:
    """The scoring function for ``name``; a ValueError names the field and the choices."""
    if name not in POLICIES:
        raise ValueError(f"eviction_policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]


class EvictionQueue:
    """The evictable leaves of a radix tree (no children, ``lock_ref == 0``), in policy order.

    The min-heap of ``(score, node id, push seq, node)`` lives across evict calls: an entry is
    pushed whenever a node joins the set or a member's score changes (``rescore``), so every
    member has an entry with its current score. Entries of nodes that left the set or were
    re-scored since are stale and skipped on pop; the heap is rebuilt when mostly stale. Evicting
    k leaves thus costs O(k log n), not a rebuild over every leaf.
    """

    def __init__(self, policy: str):
        self.score = get_policy(policy)
        self.leaves: set = set()
        self._heap: list = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.leaves)

    def __contains__(self, node) -> bool:
        return node in self.leaves

    def add(self, node) -> None:
        self.leaves.add(node)
        self._push(node)

    def discard(self, node) -> None:
        self.leaves.discard(node)

    def rescore(self, node) -> None:
        """Call after a member's access time, hit count or priority changed."""
        if node in self.leaves:
            self._push(node)

    def pop(self):
        """Remove and return the member the policy evicts first (IndexError when empty)."""
        while True:
            if not self._heap and self.leaves:  # a member re-stamped without rescore: its
                self._rebuild()                 # entries all went stale; score it afresh
            entry_score, _, _, node = heapq.heappop(self._heap)
            if node in self.leaves and entry_score == self.score(node):
                self.leaves.remove(node)
                return node

    def _rebuild(self) -> None:
        self._heap = [(self.score(n), n.id, next(self._seq), n) for n in self.leaves]
        heapq.heapify(self._heap)

    def _push(self, node) -> None:
        if len(self._heap) > 2 * len(self.leaves) + 64:  # mostly stale entries: rebuild
            self._rebuild()
            if node in self.leaves:
                return
        heapq.heappush(self._heap, (self.score(node), node.id, next(self._seq), node))
