"""An approximate radix tree of request text: which worker has seen which prefix, recently.

The router cannot see the engines' KV caches, so it remembers the text it sent to each worker.
Every node holds an edge label (a run of characters) and the set of workers ("tenants") whose
requests passed through it. Two invariants keep it simple:

* a node's tenants include every tenant of its children (an insert marks the whole path, and
  eviction only takes a tenant off a node none of whose children hold that tenant), so walking
  down a request's path the tenant sets only shrink, and a node with no tenant has no children;
* each tenant's size (the characters of all nodes it holds) stays <= ``max_chars_per_tenant``
  (or a smaller per-insert bound): the bound is enforced on every insert by evicting that
  tenant's least recently used leaves.

Per tenant, an OrderedDict keeps its nodes from least to most recently used. An insert touches
the path from the leaf up, so within one request a parent is more recent than its child and the
oldest entry is normally a leaf of that tenant; after a split it may not be, and eviction then
skips (refreshes) it. That is the "approximate" in the name: recency, not exact timestamps.
"""

from __future__ import annotations

from collections import OrderedDict


class Node:
    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: "Node | None"):
        self.text = text
        self.parent = parent
        self.children: dict[str, Node] = {}  # first character of the child's text -> child
        self.tenants: set[str] = set()


def _common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]`` (C-speed compares)."""
    n = min(len(edge), len(text) - start)
    if text.startswith(edge[:n], start):
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == text[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixMatch:
    """The path a request's text takes through the tree: (node, matched chars up to it) pairs."""

    __slots__ = ("path", "text_len")

    def __init__(self, path: list[tuple[Node, int]], text_len: int):
        self.path = path
        self.text_len = text_len

    def best(self, allowed) -> tuple[int, list[str]]:
        """Longest match among tenants in ``allowed`` (a container of urls) and who holds it."""
        for node, depth in reversed(self.path):
            holders = [t for t in node.tenants if t in allowed]
            if holders:
                return depth, holders
        return 0, []

    def chars_for(self, tenant: str) -> int:
        """Characters of the request that ``tenant`` is predicted to have cached."""
        for node, depth in reversed(self.path):
            if tenant in node.tenants:
                return depth
        return 0


class ApproxRadixTree:
    def __init__(self, max_chars_per_tenant: int):
        if max_chars_per_tenant < 1:
            raise ValueError("max_chars_per_tenant: must be >= 1")
        self.max_chars = max_chars_per_tenant
        self.root = Node("", None)
        self._lru: dict[str, OrderedDict[Node, None]] = {}
        self._size: dict[str, int] = {}
        self.evicted_chars = 0  # cumulative, for tests and benchmarks
        # Bumped whenever whole tenants are forgotten (a flush, a restart, a removal): text
        # learned from an answer that came before must not bring their entries back.
        self.forget_count = 0

    # ----------------------------------------------------------------------------------- reads
    def match(self, text: str) -> PrefixMatch:
        """Walk ``text`` down the tree. Mutates nothing (recency changes only on insert)."""
        node, i, path = self.root, 0, []
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common_prefix_len(child.text, text, i)
            i += k
            path.append((child, i))
            if k < len(child.text):
                break  # diverged inside the edge: the child's tenants still share text[:i]
            node = child
        return PrefixMatch(path, len(text))

    def size(self, tenant: str) -> int:
        return self._size.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._size)

    def total_chars(self) -> int:
        """Characters actually stored (shared nodes counted once)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.text)
            stack.extend(node.children.values())
        return total

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count - 1

    # ---------------------------------------------------------------------------------- writes
    def insert(self, text: str, tenant: str, max_chars: int | None = None) -> None:
        """Record that ``tenant`` now caches ``text``; refreshes the path's recency and evicts
        ``tenant``'s least recently used leaves until it is back within its bound
        (``max_chars`` if given, e.g. the worker's own KV capacity, else the tree's)."""
        if not text:
            return
        node, i, path = self.root, 0, []
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = Node(text[i:], node)
                node.children[text[i]] = child
                path.append(child)
                break
            k = _common_prefix_len(child.text, text, i)
            if k < len(child.text):
                child = self._split(child, k)
            path.append(child)
            i += k
            node = child
        lru = self._lru.setdefault(tenant, OrderedDict())
        added = 0
        for n in reversed(path):  # leaf first, so each parent ends up more recent than its child
            if tenant in n.tenants:
                lru.move_to_end(n)
            else:
                n.tenants.add(tenant)
                lru[n] = None
                added += len(n.text)
        self._size[tenant] = self._size.get(tenant, 0) + added
        bound = self.max_chars if max_chars is None else min(max_chars, self.max_chars)
        self._evict(tenant, bound)

    def evict_to(self, tenant: str, max_chars: int) -> int:
        """Evict ``tenant``'s LRU leaves until it holds <= max_chars; returns chars evicted."""
        return self._evict(tenant, max_chars)

    def forget(self, text: str, tenant: str, keep_chars: int) -> None:
        """Undo an ``insert`` of ``text`` for ``tenant`` past its first ``keep_chars`` (what it
        held before): the worker failed the request, so it did not cache it. Takes ``tenant``
        off the path's nodes deeper than that, deepest first, while they are its leaves. A
        request with the same text that the worker answered meanwhile loses its entries too:
        a routing miss later, never a wrong answer."""
        lru = self._lru.get(tenant)
        if lru is None:
            return
        path = self.match(text).path
        starts = [0] + [depth for _, depth in path[:-1]]
        for (node, depth), start in zip(reversed(path), reversed(starts)):
            whole = depth - start == len(node.text)  # else it runs on past the text
            if start < keep_chars or not whole or tenant not in node.tenants or \
                    any(tenant in c.tenants for c in node.children.values()):
                break
            del lru[node]
            node.tenants.discard(tenant)
            self._size[tenant] -= len(node.text)
            if not node.tenants:
                del node.parent.children[node.text[0]]
                node.parent = None

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything ``tenant`` holds (a worker left or died)."""
        lru = self._lru.pop(tenant, None)
        self.forget_count += 1
        if lru is None:
            return
        for node in lru:
            node.tenants.discard(tenant)
            # Children of a node left without tenants are tenant-less too (first invariant).
            if not node.tenants and node.parent is not None:
                del node.parent.children[node.text[0]]
                node.parent = None
        self.evicted_chars += self._size.pop(tenant)

    def clear(self) -> None:
        """Forget everything (the engines' caches were flushed)."""
        self.forget_count += 1
        self.root = Node("", None)
        self._lru.clear()
        self._size.clear()

    # ------------------------------------------------------------------------------- internals
    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node``'s edge after k chars; returns the new prefix node (same tenants)."""
        prefix = Node(node.text[:k], node.parent)
        prefix.tenants = set(node.tenants)
        node.parent.children[node.text[0]] = prefix
        node.text = node.text[k:]
        node.parent = prefix
        prefix.children[node.text[0]] = node
        for t in prefix.tenants:  # sizes are unchanged: the chars are only redistributed
            self._lru[t][prefix] = None
        return prefix

    def _evict(self, tenant: str, max_chars: int) -> int:
        lru = self._lru.get(tenant)
        if lru is None:
            return 0
        freed = 0
        while self._size[tenant] > max_chars and lru:
            node = next(iter(lru))
            if any(tenant in c.tenants for c in node.children.values()):
                lru.move_to_end(node)  # not a leaf for this tenant (see the module docstring)
                continue
            del lru[node]
            node.tenants.discard(tenant)
            self._size[tenant] -= len(node.text)
            freed += len(node.text)
            # A node nobody holds has no children (first invariant): drop it from the tree.
            if not node.tenants and node.parent is not None:
                del node.parent.children[node.text[0]]
                node.parent = None
        self.evicted_chars += freed
        return freed
