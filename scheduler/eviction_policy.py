"""Which unlocked leaf of the radix cache to evict first.

Each policy is one small function mapping a ``TreeNode`` to a sort key; ``RadixCache.evict``
puts the unlocked leaves in a min-heap on ``(key, node.id)`` and evicts the smallest first.
The node id breaks ties, so equal keys go oldest node first and the order is deterministic.
Times are ticks of the cache's monotonic counter, so larger means later.
"""

from __future__ import annotations

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
