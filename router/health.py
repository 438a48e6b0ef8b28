"""Active health checks: GET {worker}/health on an interval.

A worker's /health runs a real (tiny) generation, so a 200 means the engine works, not only that
the HTTP server is up. A refused connection marks the worker unhealthy at once (nothing listens
there); slow or failing answers must repeat ``health_failure_threshold`` times, so a worker busy
with a large batch is not dropped for one slow check. One good check makes a worker healthy again,
half-opens its open circuit or counts toward closing a half-open one (circuit.py says why it does
not close it outright).
Every answer carries the worker's cache epoch (here and in the proxy): a new one means the worker
restarted or flushed since, and the router forgets what it believed cached there.

After a worker's first good check its /get_server_info is read once, to bound its share of the
router's tree by its KV capacity (see RouterConfig.tree_chars_per_token).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from .config import CACHE_EPOCH_HEADER, RouterConfig
from .workers import Worker, WorkerRegistry

log = logging.getLogger("radixray.router")


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, config: RouterConfig):
        self.registry = registry
        self.client = client
        self.config = config

    async def check(self, worker: Worker) -> bool:
        """Probe one worker and update its ``healthy`` flag; returns the probe's verdict."""
        refused, epoch = False, None
        try:
            resp = await self.client.get(f"{worker.url}/health",
                                         timeout=self.config.health_check_timeout)
            ok = resp.status_code == 200
            epoch = resp.headers.get(CACHE_EPOCH_HEADER)
        except httpx.ConnectError:
            ok, refused = False, True
        except (httpx.HTTPError, OSError):
            ok = False
        if worker.url not in self.registry:
            return ok  # removed while we were probing
        if self.registry.observe_epoch(worker, epoch):
            log.info("worker %s restarted or flushed its cache; its tree entries are dropped",
                     worker.url)
        if ok:
            if not worker.healthy:
                log.info("worker %s is healthy again", worker.url)
            self.registry.mark_healthy(worker)
            worker.breaker.probe_passed()
            if not worker.server_info_read and self.config.tree_chars_per_token > 0:
                await self.read_capacity(worker)
        else:
            worker.health_failures += 1
            if worker.healthy and (refused or
                                   worker.health_failures >= self.config.health_failure_threshold):
                log.warning("worker %s failed its health check; no traffic until it passes",
                            worker.url)
                self.registry.mark_unhealthy(worker)
        return ok

    async def read_capacity(self, worker: Worker) -> None:
        """Size ``worker``'s tree bound from its KV capacity (sets ``worker.tree_limit``);
        a worker that does not report ``max_total_num_tokens`` keeps the global bound."""
        worker.server_info_read = True
        try:
            key = self.config.worker_api_key
            auth = {"Authorization": f"Bearer {key}"} if key else None
            resp = await self.client.get(f"{worker.url}/get_server_info", headers=auth,
                                         timeout=self.config.health_check_timeout)
            tokens = resp.json().get("max_total_num_tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            tokens = None
        if isinstance(tokens, int) and tokens > 0:
            worker.tree_limit = max(1, min(self.config.max_tree_size,
                                           int(tokens * self.config.tree_chars_per_token)))
            log.info("worker %s: %d KV tokens, tree bound %d chars", worker.url, tokens,
                     worker.tree_limit)

    async def check_all(self) -> None:
        """Check every worker at once. A check that raises (a bug, an answer nobody foresaw) is
        logged and skips that worker this round only: an exception escaping here would end
        ``run`` for good, and with it every later check, silently."""
        workers = self.registry.all()
        results = await asyncio.gather(*(self.check(w) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results):
            if isinstance(result, Exception):
                log.error("health check of %s failed", worker.url, exc_info=result)

    async def run(self) -> None:
        """Check every worker each interval, forever (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.check_all()
