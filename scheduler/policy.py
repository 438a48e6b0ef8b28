"""Waiting-queue policies (``--schedule-policy``) and in-batch prefix sharing.

A policy reorders the waiting queue in place before each prefill round; the prefill adder then
takes requests from the front. Each policy is a small class in ``POLICIES``; stable sorts keep
the queue's order (arrival, with retracted requests in front) among equals. A policy that
orders by something else than arrival or an explicit priority is wrapped in ``OldestFirst``,
so that no request waits behind a stream of others for ever.

``InBatchPrefixSharing`` works inside one round: among requests that missed the cache, one that
shares a long prefix with a request admitted ahead of it is held back, so the prefix is computed
once and the others hit the cache in the next round.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from .cache_manager import CacheManager
from .radix_cache import RadixCache
from .request import Req

LPM_FALLBACK_QUEUE_LEN = 128  # matching every waiting prompt each round stops paying off
IN_BATCH_CHECK_THRESHOLD = 32  # a cache hit up to this counts as a miss (SGLang's rule)
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32  # hold back when sharing saves at least this much


@dataclass
class QueueView:
    """What policies may look at besides the queue itself."""

    cache: CacheManager
    running: list[Req]


class FcfsPolicy:
    """First come, first served: the queue as it stands."""

    def order(self, waiting: list[Req], view: QueueView) -> None:
        pass  # the queue is already in arrival order


class LongestPrefixMatchPolicy:
    """Requests with the longest cached prefix first (they cost least and keep hot prefixes
    hot). Matching every prompt costs a tree walk each, so above 128 waiting requests, and
    when there is no cache, it falls back to FCFS."""

    def order(self, waiting: list[Req], view: QueueView) -> None:
        if view.cache.disabled or len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            return
        hits = {id(r): view.cache.match(r) for r in waiting}
        waiting.sort(key=lambda r: -hits[id(r)])


class DfsWeightPolicy:
    """Walk the radix tree depth first, heaviest subtree (most waiting requests) first, and
    queue the requests in that order, so requests sharing a prefix run back to back."""

    def order(self, waiting: list[Req], view: QueueView) -> None:
        if view.cache.disabled or len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            return
        for r in waiting:
            view.cache.match(r)
        at_node: dict = defaultdict(list)
        weight: Counter = Counter()
        for r in waiting:
            at_node[r.last_node].append(r)
            node = r.last_node
            while node is not None:  # only paths that lead to a waiting request count
                weight[node] += 1
                node = node.parent
        # Post-order: a subtree's requests (longer shared prefixes) before the node's own.
        ordered: list[Req] = []
        stack = [(view.cache.tree.root, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                ordered.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if weight[c] > 0]
            children.sort(key=lambda c: weight[c])  # the heaviest ends on top: visited first
            stack.extend((c, False) for c in children)
        waiting[:] = ordered


class LongestOutputFirstPolicy:
    """Largest ``max_new_tokens`` first."""

    def order(self, waiting: list[Req], view: QueueView) -> None:
        waiting.sort(key=lambda r: -r.sampling_params.max_new_tokens)


class RandomPolicy:
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def order(self, waiting: list[Req], view: QueueView) -> None:
        self.rng.shuffle(waiting)


class PriorityPolicy:
    """Higher ``priority`` first (missing counts as 0); FCFS among equals."""

    def order(self, waiting: list[Req], view: QueueView) -> None:
        waiting.sort(key=lambda r: -(r.priority or 0))


class RoutingKeyPolicy:
    """Requests whose routing key is already running first, the most common key first: they
    are likely to share the running requests' prefixes."""

    def order(self, waiting: list[Req], view: QueueView) -> None:
        running = Counter(r.routing_key for r in view.running if r.routing_key is not None)
        waiting.sort(key=lambda r: -running.get(r.routing_key, 0))


POLICIES = {
    "fcfs": FcfsPolicy,
    "lpm": LongestPrefixMatchPolicy,
    "dfs-weight": DfsWeightPolicy,
    "lof": LongestOutputFirstPolicy,
    "random": RandomPolicy,
    "priority": PriorityPolicy,
    "routing-key": RoutingKeyPolicy,
}


# Orders that may pass a request over for as long as others keep arriving: lpm and dfs-weight
# (a prompt that hits nothing, behind prompts that hit), lof (a short answer behind long
# ones), routing-key (a key nothing running shares).
UNFAIR_POLICIES = ("lpm", "dfs-weight", "lof", "routing-key")


class OldestFirst:
    """``inner``'s order, except that requests waiting longer than ``max_wait_s`` go first,
    oldest first. Under SGLang's lpm a request with no cache hit waits for ever while requests
    that hit keep coming (a probe: 600 steps, 410 others served); past the bound the queue
    turns first come, first served for it, which is also what an overloaded queue gets."""

    def __init__(self, inner, max_wait_s: float, clock=time.perf_counter):
        self.inner, self.max_wait_s, self.clock = inner, max_wait_s, clock

    def order(self, waiting: list[Req], view: QueueView) -> None:
        self.inner.order(waiting, view)
        now = self.clock()
        overdue = [r for r in waiting if now - r.submitted_at > self.max_wait_s]
        if overdue:
            first = {id(r) for r in overdue}
            overdue.sort(key=lambda r: r.submitted_at)
            waiting[:] = overdue + [r for r in waiting if id(r) not in first]


def make_policy(name: str, seed: int = 0, max_wait_s: float = 0.0):
    """The policy ``name``; one of ``UNFAIR_POLICIES`` wrapped in ``OldestFirst`` when
    ``max_wait_s`` > 0."""
    if name not in POLICIES:
        raise ValueError(f"schedule_policy: must be one of {', '.join(POLICIES)} (got {name!r})")
    policy = POLICIES[name](seed) if name == "random" else POLICIES[name]()
    return OldestFirst(policy, max_wait_s) if name in UNFAIR_POLICIES and max_wait_s > 0 \
        else policy


class InBatchPrefixSharing:
    """One prefill round's simulated radix tree of the prompts ahead in this round (tokens
    only, no slots): the requests admitted so far and the one mid-chunk. Create one per round;
    ask ``hold_back`` for each candidate in queue order.

    SGLang's rule holds back a request that missed the cache (hit <= 32 tokens) but shares
    >= 32 tokens with a request ahead of it. radixray also holds back one whose share exceeds
    its cache hit by >= 32 tokens: a group's later requests, while the first one's prompt is
    still being computed in chunks, hit only the chunks done so far and would otherwise
    compute the rest of the shared prefix again, each of them.
    """

    def __init__(self):
        self.tree = RadixCache()  # simulated allocator: no real slots

    def add(self, req: Req) -> None:
        """Count ``req``'s prompt as ahead of every later candidate (the chunked request)."""
        key = req.match_key()
        self.tree.insert(key, torch.zeros(len(key), dtype=torch.int64))

    def hold_back(self, req: Req) -> bool:
        """True when ``req`` should wait a round (see the class docstring); otherwise its
        prompt joins the simulated tree. ``req`` must be matched against the real cache."""
        key = req.match_key()
        shared, hit = len(self.tree.match_prefix(key).indices), req.tree_len
        missed_cache = hit <= IN_BATCH_CHECK_THRESHOLD and shared >= IN_BATCH_DEPRIORITIZE_THRESHOLD
        if missed_cache or shared - hit >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
            return True
        self.tree.insert(key, torch.zeros(len(key), dtype=torch.int64))
        return False

