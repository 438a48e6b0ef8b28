"""RadixCache: a prefix tree from token ids to KV slot indices (RadixAttention, SGLang-style).

The tree stores no K/V tensors, only the slot numbers that ``TokenToKVPoolAllocator`` handed
out. A request whose prompt starts with a cached prefix reuses those slots and skips their
prefill. Each edge holds a run of tokens (``TreeNode.key``) and the slots of those tokens
(``TreeNode.value``); children are keyed by their first token (first page when
``page_size > 1``) together with the key's ``extra_key``, so keys with different extra keys never
share a node.

Edges are compared on a packed ``bytes`` copy of the token ids (4 bytes per token) so each
comparison is one C-level ``memcmp``: first the whole overlap at once (on a cache hit it usually
all matches: one comparison), and when that fails, windows of 1, 2, 4, 8 ... tokens (galloping)
and a bisection inside the first unequal window: about 2*log2(n) comparisons for an n-token
edge instead of an n-step Python loop.

Ownership of slots: slots inside the tree belong to the tree until ``evict`` (or ``reset``)
frees them through the allocator. Locked nodes (``lock_ref > 0``, held by running requests)
and their ancestors are never evicted.

Not thread-safe: one scheduler owns the cache, and every public method must be called with
whatever lock guards the scheduler's state held (in radixray, from the scheduler thread only).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from .eviction_policy import EvictionQueue, get_policy
from .memory_pool import SimulatedAllocator
from .radix_key import _BYTES_PER_TOKEN, RadixKey


def _head(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[:n]


def _tail(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[n:]


class TreeNode:
    """One edge of the tree: ``key`` tokens whose KV lives in slots ``value``. With the
    hierarchical cache (``hicache.py``) ``host_value`` holds the host-tier slots of a copy, and
    ``value`` is None while the KV is on the host only."""

    __slots__ = ("children", "parent", "key", "value", "host_value", "lock_ref",
                 "last_access_time", "creation_time", "hit_count", "priority", "id")
    _ids = itertools.count()

    def __init__(self, key: RadixKey | None = None, value: torch.Tensor | None = None,
                 parent: TreeNode | None = None, time: int = 0, priority: int = 0):
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.host_value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = time
        self.creation_time = time
        self.hit_count = 0
        self.priority = priority
        self.id = next(TreeNode._ids)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={0 if self.key is None else len(self.key)}, "
                f"lock_ref={self.lock_ref}, hits={self.hit_count})")


class MatchResult(NamedTuple):
    indices: torch.Tensor  # 1-D int64 slots of the matched prefix; read-only (may be the tree's)
    last_node: TreeNode    # deepest matched node (the root on a miss): what a request locks


class RadixCache:
    """Prefix tree of cached KV slots. See the module docstring for ownership and locking."""

    def __init__(self, allocator=None, page_size: int = 1, eviction_policy: str = "lru",
                 disable: bool = False):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if allocator is None:
            allocator = SimulatedAllocator(page_size)
        if getattr(allocator, "page_size", page_size) != page_size:
            raise ValueError(f"page_size {page_size} differs from the allocator's page_size "
                             f"{allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        get_policy(eviction_policy)  # a bad name fails here, naming the field
        self.eviction_policy = eviction_policy
        self.disable = disable
        self._clock = itertools.count(1)  # monotonic ticks for access and creation times
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode()
        self._evictable_size = 0
        self._protected_size = 0
        # Leaves with lock_ref == 0, in policy order: exactly the nodes evict may take next.
        self._evictable = EvictionQueue(self.eviction_policy)

    # ---- sizes -------------------------------------------------------------------------------

    def total_size(self) -> int:
        """Tokens (= slots) held by the tree."""
        return self._evictable_size + self._protected_size

    def evictable_size(self) -> int:
        """Tokens in nodes no running request has locked."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in locked nodes (and their ancestors)."""
        return self._protected_size

    # ---- lookup and insertion ----------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix of ``key``, rounded down to whole pages.

        Mutates: stamps ``last_access_time`` on the matched nodes and, when the match ends inside
        an edge, splits that node in two (sizes are unchanged; no KV moves). Does not lock: the
        caller locks ``last_node`` with ``inc_lock_ref`` before anything may evict.
        """
        self._check_key(key)
        n = len(key.token_ids)
        n -= n % self.page_size
        if self.disable or n == 0:
            return MatchResult(torch.empty(0, dtype=torch.int64), self.root)
        node, _, path = self._walk(key, n, next(self._clock))
        self._evictable.rescore(node)  # its access time changed (the path's others are inner)
        if not path:
            return MatchResult(torch.empty(0, dtype=torch.int64), self.root)
        if len(path) == 1:
            return MatchResult(path[0].value, node)
        return MatchResult(torch.cat([p.value for p in path]), node)

    def insert(self, key: RadixKey, value, is_chunk: bool = False, priority: int = 0) -> int:
        """Cache ``key`` with KV slots ``value`` (one per token); return how many leading tokens
        were already cached.

        Only the first ``len(key) // page_size * page_size`` tokens are stored. The tree takes
        ownership of ``value[returned:aligned]``. The caller still owns, and must free when it is
        done with them, the slots it computed itself for ``value[:returned]`` (the tree kept its
        own copy of those tokens) and the partial-page tail ``value[aligned:]``.
        ``is_chunk=True`` (chunked-prefill progress) leaves hit counts alone; ``priority`` is
        raised to at least this value on every node of the path.

        Disabled cache: nothing is stored and 0 is returned; a final insert (``is_chunk=False``)
        frees ``value[:aligned]`` through the allocator, a chunk insert frees nothing.

        Mutates: the tree (new leaf, maybe a split), access times, hit counts, priorities, sizes.
        """
        self._check_key(key)
        value = self._check_value(key, value)
        n = len(key) - len(key) % self.page_size
        if self.disable:
            if not is_chunk and n:
                self.allocator.free(value[:n])
            return 0
        if n == 0:
            return 0
        priority = priority or 0  # requests without a priority send None
        now = next(self._clock)
        node, matched, path = self._walk(key, n, now)
        for p in path:
            if not is_chunk:
                p.hit_count += 1
            if priority > p.priority:
                p.priority = priority
        if matched < n:
            leaf = TreeNode(key[matched:n], value[matched:n].clone(), node, now, priority)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable.discard(node)
            self._evictable.add(leaf)
            self._evictable_size += n - matched
            self._on_new_leaf(leaf)
        else:
            self._evictable.rescore(node)
        return matched

    def _walk(self, key: RadixKey, n: int, now: int):
        """Follow ``key[:n]`` from the root; return (deepest node, tokens matched, nodes passed).

        Splits the last node passed where the match ends inside it, and stamps ``now`` on each
        node passed (for a split, on the matched upper part only).
        """
        packed, extra = key.packed, key.extra_key
        page_bytes = self.page_size * _BYTES_PER_TOKEN
        node, matched, path = self.root, 0, []
        while matched < n:
            start = matched * _BYTES_PER_TOKEN
            child = node.children.get((extra, packed[start : start + page_bytes]))
            if child is None:
                break
            length = self._edge_match_len(child.key, key, matched, n)
            length -= length % self.page_size
            ends_inside = length < len(child.key.token_ids)
            if ends_inside:
                child = self._split(child, length)
            child.last_access_time = now
            path.append(child)
            matched += length
            node = child
            if ends_inside:
                break
        return node, matched, path

    def _edge_match_len(self, edge: RadixKey, key: RadixKey, start: int, stop: int) -> int:
        """How many leading tokens of ``edge`` equal ``key[start:stop]``."""
        a, b, w = edge.packed, key.packed, _BYTES_PER_TOKEN
        count = min(len(a) // w, stop - start)
        base = start * w
        # bytes.startswith(x, i) is a memcmp of x against b[i:] without copying b's slice.
        if b.startswith(a if count * w == len(a) else a[: count * w], base):
            return count  # the usual case: the whole edge (or the whole rest of the key)
        # Gallop with windows 1, 2, 4, ... to the first unequal one, then bisect inside it.
        pos, width = 0, 1
        while True:
            end = min(pos + width, count)
            if not b.startswith(a[pos * w : end * w], base + pos * w):
                break
            pos, width = end, width * 2
        lo, hi = pos, end  # tokens before lo are equal; the first difference is in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if b.startswith(a[lo * w : mid * w], base + lo * w):
                lo = mid
            else:
                hi = mid
        return lo

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child``'s edge after ``length`` tokens; the new upper node is returned and
        ``child`` keeps the rest (and its children, lock and leaf status)."""
        upper = TreeNode(child.key[:length], _head(child.value, length), child.parent,
                         child.creation_time, child.priority)
        upper.host_value = _head(child.host_value, length)
        upper.last_access_time = child.last_access_time
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        child.parent.children[self._child_key(upper.key)] = upper
        child.key = child.key[length:]
        child.value = _tail(child.value, length)
        child.host_value = _tail(child.host_value, length)
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ---- locking -----------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect ``node`` and its ancestors from eviction (a running request uses them).

        Mutates ``lock_ref`` on the path to the root and moves newly locked tokens from
        evictable to protected; returns how many tokens moved. The root is a no-op.
        """
        if node is not self.root and node.parent is None:
            raise ValueError("inc_lock_ref: node is no longer in the tree (evicted); match again")
        moved = 0
        while node is not self.root:
            if node.lock_ref == 0:
                moved += node.value.shape[0]
                self._evictable.discard(node)  # a no-op unless it was an evictable leaf
            node.lock_ref += 1
            node = node.parent
        self._evictable_size -= moved
        self._protected_size += moved
        return moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``. Mutates ``lock_ref`` on the path and moves tokens
        whose count reaches 0 back to evictable; returns how many tokens moved."""
        if node is not self.root and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node ({node!r})")
        moved = 0
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += node.value.shape[0]
                if self._device_leaf(node):
                    self._evictable.add(node)
            node = node.parent
        self._evictable_size += moved
        self._protected_size -= moved
        return moved

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (whole leaves, so possibly more) from unlocked
        leaves in policy order, or everything evictable if that is less; return how many.

        Mutates: removes nodes, frees their slots through the allocator, updates sizes.
        Costs nothing when nothing is evictable.
        """
        if num_tokens <= 0 or not self._evictable:
            return 0
        freed, released = 0, []
        while freed < num_tokens and self._evictable:
            node = self._evictable.pop()
            released.append(node.value)
            freed += node.value.shape[0]
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            node.parent = None  # marks it evicted for inc_lock_ref
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._evictable.add(parent)
        self._evictable_size -= freed
        self.allocator.free(torch.cat(released))
        return freed

    def reset(self) -> None:
        """Empty the tree, freeing all its slots through the allocator (call it before any
        ``allocator.clear()``, never after). Refused while a running request holds a lock."""
        if self._protected_size:
            raise RuntimeError(f"reset: {self._protected_size} cached tokens are locked by "
                               "running requests")
        values, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            values.extend(c.value for c in node.children.values())
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()

    # ---- tiers: one here (the device); HiRadixCache (hicache.py) adds the host ---------------

    def match_tiers(self, key: RadixKey) -> tuple[MatchResult, list[TreeNode]]:
        """``match_prefix`` and the host-only nodes that continue it: none without a host tier."""
        return self.match_prefix(key), []

    def start_load(self, nodes: list[TreeNode]) -> None:
        """Start loading host-only ``nodes`` back to the device: there are none here."""
        return None

    def loading_size(self) -> int:
        """Device slots held by pending host->device loads: none without a host tier."""
        return 0

    def has_queued_copies(self) -> bool:
        return False

    def take_copies(self) -> tuple[None, None, None]:
        """Tier copies queued for the next batch (stores, loads, ticket): none here."""
        return None, None, None

    def ack_copies(self, ticket, stores_ok: bool = True, loads_ok: bool = True) -> None:
        """Settle a batch's tier copies (HiRadixCache): nothing to settle here."""

    def check_tiers(self) -> None:
        """Per-tier checks (the device tier's: ``CacheManager.check_invariant``)."""

    # ---- helpers -----------------------------------------------------------------------------

    def _device_leaf(self, node: TreeNode) -> bool:
        """Whether ``node`` may be evicted once unlocked (HiRadixCache: no child on the device)."""
        return not node.children

    def _on_new_leaf(self, leaf: TreeNode) -> None:
        """Called by ``insert`` for each leaf it creates (HiRadixCache: write-through copy)."""

    def _child_key(self, key: RadixKey):
        return key.extra_key, key.packed[: self.page_size * _BYTES_PER_TOKEN]

    @staticmethod
    def _check_key(key) -> None:
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")

    @staticmethod
    def _check_value(key: RadixKey, value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, dtype=torch.int64)
        if value.dim() != 1 or value.shape[0] != len(key):
            raise ValueError(f"insert: value must be 1-D with one slot per token: key has "
                             f"{len(key)} tokens, value has shape {tuple(value.shape)}")
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"insert: value must hold integer slot indices, got {value.dtype}")
        return value.to(torch.int64)

    def pretty_print(self) -> str:
        """Print the tree, one node per line, and return the same text. Mutates nothing."""
        lines = [f"RadixCache(total={self.total_size()}, evictable={self.evictable_size()}, "
                 f"protected={self.protected_size()}, policy={self.eviction_policy})"]

        stack = [(self.root, 0)]  # iterative: a long chain of splits may be deep
        while stack:
            node, depth = stack.pop()
            if node is not self.root:
                lines.append(f"{'  ' * depth}{node.key!r} lock_ref={node.lock_ref} "
                             f"hits={node.hit_count}")
            children = sorted(node.children.values(), key=lambda c: c.key.token_ids)
            stack.extend((c, depth + 1) for c in reversed(children))
        text = "\n".join(lines)
        print(text)
        return text
