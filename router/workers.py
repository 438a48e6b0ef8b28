"""The worker registry: which workers exist, how loaded they are, and whether they may get traffic.

A worker is available when it is healthy (health checks, or no connection failure or "restarting"
answer since the last good check) and its circuit breaker is not open. Listeners registered with
``on_down`` hear when a worker is removed, turns unhealthy or answers with a new cache epoch
(it restarted or flushed between two health checks), so the router can drop its tree entries:
that worker's cache is empty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from .circuit import CircuitBreaker
from .config import RouterConfig


def normalize_url(url) -> str:
    """'http://host:port' without trailing slash; ValueError naming the field ``url`` otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"url: must be a non-empty string, got {url!r}")
    url = url.strip().rstrip("/")
    try:
        url.encode("ascii")  # a URL is ASCII (a lone surrogate broke every later /workers)
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        httpx.URL(url)  # what the proxy and the health checks will use it with
    except (ValueError, httpx.InvalidURL):
        raise ValueError(f"url: not a usable http://host:port URL: {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url: must look like http://host:port, got {url!r}")
    return url


@dataclass(eq=False)
class Worker:
    url: str
    breaker: CircuitBreaker
    source: str = "static"  # static | api | ray: discovery only removes what it added
    load: int = 0  # requests in flight through this router
    healthy: bool = True
    health_failures: int = 0  # consecutive failed health checks
    served: int = 0  # requests answered successfully (for load-spread figures)
    tree_limit: int | None = None  # this worker's tree bound in chars, from its KV capacity
    server_info_read: bool = False  # /get_server_info was asked once (answer or not)
    cache_epoch: str | None = None  # the worker's CACHE_EPOCH_HEADER, newest seen
    retired_engines: set[str] = field(default_factory=set)  # engine ids of older epochs

    def available(self) -> bool:
        return self.healthy and self.breaker.allows()


class WorkerRegistry:
    def __init__(self, config: RouterConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self._down_listeners = []  # callables(url) run when a worker is removed or turns unhealthy

    def on_down(self, callback) -> None:
        self._down_listeners.append(callback)

    # ----------------------------------------------------------------------------------- reads
    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def available(self) -> list[Worker]:
        """Workers that may get generation traffic now (healthy, circuit not open)."""
        return [w for w in self._workers.values() if w.available()]

    def healthy(self) -> list[Worker]:
        """Workers passing health checks, whatever their breaker says: /health, /flush_cache
        and /abort_request concern the worker, not the requests it failed lately."""
        return [w for w in self._workers.values() if w.healthy]

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, url: str) -> bool:
        return url in self._workers

    # ---------------------------------------------------------------------------------- writes
    def add(self, url: str, source: str = "static") -> Worker:
        """Register a worker (healthy until a check says otherwise); adding a known url is a
        no-op that returns the existing worker."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None:
            c = self.config
            breaker = CircuitBreaker(c.breaker_failure_threshold, c.breaker_window,
                                     c.breaker_cooldown, c.breaker_success_threshold, self.clock)
            worker = Worker(url, breaker, source)
            self._workers[url] = worker
        return worker

    def remove(self, url: str) -> Worker | None:
        """Unregister a worker; in-flight requests to it finish, listeners forget its state."""
        worker = self._workers.pop(normalize_url(url), None)
        if worker is not None:
            self._notify_down(worker.url)
        return worker

    def mark_healthy(self, worker: Worker) -> None:
        worker.health_failures = 0
        worker.healthy = True

    def mark_unhealthy(self, worker: Worker) -> None:
        """Stop sending traffic to ``worker`` until a health check passes; listeners drop its
        tree entries."""
        was_healthy = worker.healthy
        worker.healthy = False
        if was_healthy:
            self._notify_down(worker.url)

    def observe_epoch(self, worker: Worker, epoch: str | None) -> bool:
        """Record the cache epoch an answer of ``worker`` carried; True (and listeners drop its
        tree entries) when it is newer than the last one seen. Answers without one (workers
        that do not send it, the router's own errors) change nothing, and neither does an
        older one (a slow answer overtaken by a newer one): epochs read ``<engine>.<flushes>``,
        newer being a new engine or more flushes. A new engine also gets a closed circuit: the
        failures that opened it were its predecessor's."""
        if not epoch or epoch == worker.cache_epoch:
            return False
        engine, _, flushes = epoch.rpartition(".")
        if engine in worker.retired_engines:
            return False
        if worker.cache_epoch is not None:
            last_engine, _, last_flushes = worker.cache_epoch.rpartition(".")
            if engine == last_engine and flushes.isdigit() and last_flushes.isdigit() \
                    and int(flushes) < int(last_flushes):
                return False
            if engine != last_engine:
                worker.retired_engines.add(last_engine)
                worker.breaker.reset()
        changed = worker.cache_epoch is not None
        worker.cache_epoch = epoch
        if changed:
            worker.server_info_read = False  # a restarted engine may have another capacity
            self._notify_down(worker.url)
        return changed

    def _notify_down(self, url: str) -> None:
        for callback in self._down_listeners:
            callback(url)
