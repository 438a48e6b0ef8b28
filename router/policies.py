"""Routing policies: given a request and the available workers, pick one.

Every policy has the same shape, ``choose(info, candidates, match) -> Decision``; ``match`` is the
request's path through the approximate radix tree (the proxy computes it once per request, for
every policy, so the predicted hit rate is comparable across policies). Policies hold no worker
state of their own beyond counters and a hash ring cache: loads live on the Worker objects.

``Decision.kind`` feeds the ``policy_decisions_total{decision}`` metric: cache_hit, cache_miss and
balance for cache_aware, "other" for the rest.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from .config import RouterConfig
from .tree import ApproxRadixTree, PrefixMatch
from .workers import Worker


@dataclass(frozen=True)
class RequestInfo:
    text: str  # what the tree sees (see request.py for how it is derived)
    routing_key: str | None = None  # for consistent_hash
    stream: bool = False  # the client asked for a server-sent-event stream
    # native: copies of each prompt in the answer, one n for all or one per prompt
    # (request.copies_per_prompt)
    copies: int | tuple[int, ...] = 1
    by_ids: bool = False  # ``text`` spells the prompt's token ids (one character each)
    continues: bool = False  # chat ``continue_final_message``: the answer extends the last one
    prompts: int = 1  # a batch's size (its answers are not learned: ``text`` is its first)


@dataclass(frozen=True)
class Decision:
    worker: Worker
    kind: str  # cache_hit | cache_miss | balance | other


def least_loaded(candidates: list[Worker], rng: random.Random,
                 tie_break: Callable[[Worker], int] | None = None) -> Worker:
    """The worker with the fewest in-flight requests; ties go to the lowest ``tie_break``
    value, then at random, so that sequential requests (all loads 0) spread instead of piling
    onto the first worker."""
    low = min(w.load for w in candidates)
    ties = [w for w in candidates if w.load == low]
    if len(ties) > 1 and tie_break is not None:
        least = min(tie_break(w) for w in ties)
        ties = [w for w in ties if tie_break(w) == least]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class Policy:
    name = "base"

    def __init__(self, config: RouterConfig, rng: random.Random,
                 tree: ApproxRadixTree | None = None):
        self.config = config
        self.rng = rng
        self.tree = tree  # the router's tree, for policies that weigh what workers hold

    def choose(self, info: RequestInfo, candidates: list[Worker], match: PrefixMatch) -> Decision:
        raise NotImplementedError


class CacheAwarePolicy(Policy):
    """Longest cached prefix wins, unless the load is imbalanced or the match is too short."""

    name = "cache_aware"

    def choose(self, info, candidates, match):
        c = self.config
        if len(candidates) > 1:
            loads = [w.load for w in candidates]
            high, low = max(loads), min(loads)
            if high - low > c.balance_abs_threshold and high > low * c.balance_rel_threshold:
                return Decision(least_loaded(candidates, self.rng), "balance")
        if info.text:
            matched, holders = match.best({w.url for w in candidates})
            if holders and matched / len(info.text) >= c.cache_threshold:
                held = set(holders)  # in candidate order, so a seeded run repeats exactly
                pool = [w for w in candidates if w.url in held]
                return Decision(least_loaded(pool, self.rng), "cache_hit")
        # A miss goes to the least loaded worker, not the one with the smallest tree: the smallest
        # tree stays smallest while it is being filled, so it would collect every miss. Among
        # equally loaded workers the smaller tree wins: a new prefix (a new tenant) goes where
        # fewer prefixes live, so tenants, and with them the load they bring, split evenly
        # instead of by coin flips.
        size = (lambda w: self.tree.size(w.url)) if self.tree is not None else None
        return Decision(least_loaded(candidates, self.rng, size), "cache_miss")


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, config, rng, tree=None):
        super().__init__(config, rng, tree)
        self._next = 0

    def choose(self, info, candidates, match):
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(worker, "other")


class RandomPolicy(Policy):
    name = "random"

    def choose(self, info, candidates, match):
        return Decision(self.rng.choice(candidates), "other")


class PowerOfTwoPolicy(Policy):
    """Two workers at random, the less loaded of them: near least-load spread, O(1) per request."""

    name = "power_of_two"

    def choose(self, info, candidates, match):
        if len(candidates) == 1:
            return Decision(candidates[0], "other")
        a, b = self.rng.sample(candidates, 2)
        return Decision(a if a.load <= b.load else b, "other")


class LeastLoadPolicy(Policy):
    name = "least_load"

    def choose(self, info, candidates, match):
        return Decision(least_loaded(candidates, self.rng), "other")


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class ConsistentHashPolicy(Policy):
    """A hash ring over the available workers, ``VNODES`` points each: a routing key always maps
    to the same worker while it is available, and a worker leaving moves only its own keys.
    Requests without a key go to the least loaded worker."""

    name = "consistent_hash"
    VNODES = 160  # enough points per worker for an even split of keys (spread within a few %)

    def __init__(self, config, rng, tree=None):
        super().__init__(config, rng, tree)
        self._ring_urls: frozenset[str] | None = None
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, candidates: list[Worker]) -> None:
        urls = frozenset(w.url for w in candidates)
        if urls == self._ring_urls:
            return
        ring = sorted((_hash64(f"{url}#{i}"), url) for url in urls for i in range(self.VNODES))
        self._points = [p for p, _ in ring]
        self._owners = [u for _, u in ring]
        self._ring_urls = urls

    def choose(self, info, candidates, match):
        if info.routing_key is None:
            return Decision(least_loaded(candidates, self.rng), "other")
        self._ring(candidates)
        i = bisect.bisect(self._points, _hash64(info.routing_key)) % len(self._points)
        url = self._owners[i]
        return Decision(next(w for w in candidates if w.url == url), "other")


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (CacheAwarePolicy, RoundRobinPolicy, RandomPolicy, PowerOfTwoPolicy,
                LeastLoadPolicy, ConsistentHashPolicy)
}


def make_policy(config: RouterConfig, rng: random.Random | None = None,
                tree: ApproxRadixTree | None = None) -> Policy:
    """The policy named by ``config.policy``, with its own seeded random source and (for
    ``cache_aware``'s tie-break) the router's tree."""
    try:
        cls = POLICIES[config.policy]
    except KeyError:
        raise ValueError(f"policy: unknown policy {config.policy!r}; "
                         f"choose one of {', '.join(POLICIES)}") from None
    return cls(config, rng or random.Random(config.seed), tree)
