"""The copies between the hierarchical cache's tiers, and how their outcome is settled.

``TierCopies`` is the part of ``HiRadixCache`` (``hicache.py``) that queues device <-> host
copies, hands them to the next ``ForwardBatch`` with a ``CopyTicket`` (``take_copies``) and
settles the ticket from that batch's output (``ack_copies``). The worker runs a batch's
stores, then its loads, before its forward; batches run in submission order, and their
outputs are processed in the same order. So a store reads its device slots before anything
the same batch computes or loads reuses them, and a load sees every earlier store. A copy
that raises on any rank is reported in the output (``ForwardOutput.kv_store_ok`` /
``kv_load_ok``), never raised: the scheduler recomputes instead.

- A store's host copy is in the tree as soon as it is queued (a load of it is settled after
  the store, so it can tell). If the store fails, the copy is dropped: a node on the device
  just loses it; a host-only node leaves the tree with its (host-only) subtree.
- A load is a ``LoadJob``: ``start_load`` locks the device node above the host-only path,
  pins the path (host eviction leaves it) and allocates device slots *outside the tree*, so
  nothing reads them before the ack. The requests that matched the path wait for the job
  (``Scheduler.loading``). On success the nodes take the slots and are on both tiers; on
  failure, or when a store it read from failed, the slots are freed and the path's host
  copies dropped (they may be what failed), so the waiting requests recompute those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .radix_cache import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class LoadJob:
    """One host -> device load: the host-only path ``nodes`` (in path order; a split inserts
    the upper half in place) below the device node ``parent``, which the job keeps locked, into
    ``device_slots``, which join the tree only when the load is acknowledged."""

    parent: TreeNode
    nodes: list[TreeNode]
    host_slots: torch.Tensor = _EMPTY
    device_slots: torch.Tensor = _EMPTY
    state: str = "queued"  # queued -> sent -> done | failed
    suspect: bool = False  # a store it read from failed: the load fails too

    @property
    def done(self) -> bool:
        return self.state in ("done", "failed")


@dataclass(eq=False)
class CopyTicket:
    """The copies one ForwardBatch carries; ``ack_copies`` settles them."""

    stores: list[TreeNode] = field(default_factory=list)  # nodes whose host copy it writes
    loads: list[LoadJob] = field(default_factory=list)


class TierCopies:
    """Mixed into ``HiRadixCache``: uses its tree, locks, allocators, queues and stats."""

    def _init_copies(self) -> None:
        # Copies not in a batch yet: node -> (device slots, host slots) of its store; jobs.
        self._store_queue: dict[TreeNode, tuple[torch.Tensor, torch.Tensor]] = {}
        self._load_queue: list[LoadJob] = []
        self._store_sent: dict[TreeNode, CopyTicket] = {}  # stores in a batch, not settled
        self._load_of: dict[TreeNode, LoadJob] = {}  # every node of a pending load (pinned)
        self._loading_size = 0  # device slots pending loads hold

    def loading_size(self) -> int:
        """Device slots held by loads not acknowledged yet (outside the tree)."""
        return self._loading_size

    def has_queued_copies(self) -> bool:
        return bool(self._store_queue or self._load_queue)

    # ---- loads -------------------------------------------------------------------------------

    def start_load(self, nodes: list[TreeNode]) -> LoadJob | None:
        """Start bringing the host-only ``nodes`` (a path from ``match_tiers``) back to the
        device, or return the pending job that already loads the first of them. A new job
        locks the device node above the path, pins the path, allocates device slots (evicting
        if needed) and queues one copy. None when nothing is loadable, when fewer than
        ``min_load_tokens`` are, or when the device pool is too short: the caller computes
        those tokens.

        Mutates: locks, device allocator and sizes, eviction queues, the copy queue."""
        if not nodes:
            return None
        if nodes[0] in self._load_of:
            return self._load_of[nodes[0]]
        path = []
        for node in nodes:  # stale input (evicted or being loaded meanwhile) ends the path
            if (node.parent is None or node.value is not None or node.host_value is None
                    or node in self._load_of):
                break
            path.append(node)
        total = sum(len(node.key) for node in path)
        if total < max(self.min_load_tokens, 1):
            return None  # not worth a batch of latency: computed instead
        job = LoadJob(path[0].parent, path)
        self.inc_lock_ref(job.parent)  # the closure rule needs the parent on the device
        for node in path:
            self._load_of[node] = job
            self._host_evictable.discard(node)
        self.stats.load_evicted += self.evict(total - self.allocator.available_size())
        slots = self.allocator.alloc(total)
        if slots is None:
            self._end_job(job, "failed")
            for node in path:
                if not node.children:
                    self._host_evictable.add(node)
            return None
        job.host_slots = torch.cat([node.host_value for node in path])
        job.device_slots = slots
        self._loading_size += total
        self._load_queue.append(job)
        return job

    def _finish_load(self, job: LoadJob, ok: bool) -> None:
        """Settle an acknowledged load: on success the path's nodes take its device slots
        (nodes an insert gave computed slots meanwhile free theirs); on failure the slots are
        freed and the path's host copies dropped."""
        self._loading_size -= len(job.device_slots)
        for node in job.nodes:
            self._load_of.pop(node, None)
        if not ok:
            self.allocator.free(job.device_slots)
            for node in job.nodes:  # device nodes (adopted meanwhile) first, by the closure
                self._drop_failed_copy(node)
                if node.parent is None:  # host-only: the rest of the path went with it
                    break
            self._end_job(job, "failed")
            return
        offset, surplus, fresh = 0, [], []
        for node in job.nodes:
            size = len(node.key)
            slots = job.device_slots[offset : offset + size]
            offset += size
            if node.value is not None:
                surplus.append(slots)
                continue
            node.value = slots
            self._evictable.discard(node.parent)
            self._evictable_size += size
            fresh.append(node)
        for node in fresh:  # unlocked (host-only nodes always are): a device leaf is evictable
            if self._device_leaf(node):
                self._evictable.add(node)
        if surplus:
            self.allocator.free(torch.cat(surplus))
        self.stats.loaded += sum(len(node.key) for node in fresh)
        self._end_job(job, "done")

    def _end_job(self, job: LoadJob, state: str) -> None:
        for node in job.nodes:
            self._load_of.pop(node, None)
        job.state = state
        self.dec_lock_ref(job.parent)

    # ---- stores ------------------------------------------------------------------------------

    def _queue_store(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        """``node`` (on the device) now has host copy ``host_slots``: queue the store."""
        node.host_value = host_slots
        self._host_size += len(host_slots)
        self._store_queue[node] = (node.value, host_slots)
        self.stats.stored += len(host_slots)

    def _take_host_copy(self, node: TreeNode) -> torch.Tensor:
        """Detach ``node``'s host copy (and forget its store); the caller frees the slots."""
        slots, node.host_value = node.host_value, None
        self._host_size -= len(slots)
        self._store_queue.pop(node, None)
        self._store_sent.pop(node, None)
        return slots

    def _drop_failed_copy(self, node: TreeNode) -> None:
        """``node``'s host copy may hold garbage (a copy failed): a load reading it fails; a
        node on the device just loses it; a host-only node leaves the tree with its subtree."""
        job = self._load_of.get(node)
        if job is not None:
            job.suspect = True  # its ack (this batch's or a later one's) fails it
            return
        self.stats.failed_tokens += len(node.key)
        if node.value is not None:
            self.host_allocator.free(self._take_host_copy(node))
            return
        parent = node.parent
        self._remove_subtree(node)
        if parent is not self.root:
            if parent.value is not None:
                if parent.lock_ref == 0 and self._device_leaf(parent):
                    self._evictable.add(parent)
            elif not parent.children and parent not in self._load_of:
                self._host_evictable.add(parent)

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """As ``RadixCache._split``; a queued store, a sent store and a load job follow the
        upper half too."""
        upper = super()._split(child, length)
        if child in self._store_queue:
            device, host = self._store_queue[child]
            self._store_queue[upper] = device[:length], host[:length]
            self._store_queue[child] = device[length:], host[length:]
        if child in self._store_sent:
            ticket = self._store_sent[upper] = self._store_sent[child]
            ticket.stores.append(upper)
        if child in self._load_of:
            job = self._load_of[upper] = self._load_of[child]
            job.nodes.insert(job.nodes.index(child), upper)
        return upper

    # ---- the batch interface -----------------------------------------------------------------

    def take_copies(self):
        """The copies queued since the last call, for the next ForwardBatch: ``(stores, loads,
        ticket)``. Stores and loads are each ``(from_slots, to_slots)`` or None; pass the
        ticket to ``ack_copies`` with the batch's output (all three None: nothing queued)."""
        if not self.has_queued_copies():
            return None, None, None
        ticket = CopyTicket(list(self._store_queue), self._load_queue)
        stores = loads = None
        if self._store_queue:
            pairs = list(self._store_queue.values())
            stores = torch.cat([d for d, _ in pairs]), torch.cat([h for _, h in pairs])
        if self._load_queue:
            loads = (torch.cat([job.host_slots for job in self._load_queue]),
                     torch.cat([job.device_slots for job in self._load_queue]))
        for node in ticket.stores:
            self._store_sent[node] = ticket
        for job in ticket.loads:
            job.state = "sent"
        self._store_queue, self._load_queue = {}, []
        return stores, loads, ticket

    def ack_copies(self, ticket: CopyTicket, stores_ok: bool = True,
                   loads_ok: bool = True) -> None:
        """Settle one batch's copies from its output: stores first (a load of the same batch
        may have read what they wrote), then loads (``_finish_load``).

        Mutates: host copies, the tree, both allocators, sizes, locks, job states, stats."""
        self.stats.store_failures += not stores_ok
        self.stats.load_failures += not loads_ok and bool(ticket.loads)
        self.stats.failed_batches += not stores_ok or (not loads_ok and bool(ticket.loads))
        for node in ticket.stores:
            if self._store_sent.get(node) is not ticket:
                continue  # its host copy was dropped (or replaced) since
            del self._store_sent[node]
            if not stores_ok:
                self._drop_failed_copy(node)
        for job in ticket.loads:
            self._finish_load(job, loads_ok and not job.suspect)
