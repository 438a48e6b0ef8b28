"""Workers from a Ray cluster: replicas register as named actors, the router watches them.

Each replica is a Ray actor named ``replica:<something>`` in the namespace ``radixray`` with a
``get_url()`` method returning its HTTP address. Every ``discovery_interval`` seconds the router
lists the cluster's named actors, asks each replica for its URL, adds the new ones and removes
those that vanished. Only workers that discovery added, or found among the static URLs
(``radixray serve`` lists its replicas at start-up too, so the router serves before its first
poll), are ever removed by it: a replica whose head Ray restarted elsewhere moves.

Ray is imported here, lazily, and only when no lister is injected (tests inject one).
"""

from __future__ import annotations

import asyncio
import logging
import os

from .config import RouterConfig
from .workers import WorkerRegistry, normalize_url

log = logging.getLogger("radixray.router")


class RayDiscovery:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, on_remove,
                 lister=None, url_of=None):
        """``lister()`` -> [{"name", "namespace"}] (as ray.util.list_named_actors with
        all_namespaces=True); ``url_of(name, namespace)`` -> str. Defaults talk to Ray."""
        self.config = config
        self.registry = registry
        self.on_remove = on_remove  # callable(url): removes a worker from the router
        self.lister = lister or self._ray_lister
        self.url_of = url_of or self._ray_url_of
        self.known: dict[str, str] = {}  # actor name -> url, for what discovery added

    # ------------------------------------------------------------------ blocking (in a thread)
    def discover(self) -> dict[str, str | None]:
        """Current replicas as {actor name: url}; the url is None for a replica that is listed
        but cannot answer now (still starting, or busy): it is neither added nor removed."""
        found: dict[str, str | None] = {}
        for entry in self.lister():
            name, namespace = entry.get("name", ""), entry.get("namespace")
            if namespace != self.config.ray_namespace or not name.startswith(
                    self.config.ray_actor_prefix):
                continue
            try:
                found[name] = normalize_url(self.url_of(name, namespace))
            except Exception as exc:
                found[name] = None
                log.debug("replica %s has no usable URL now: %s", name, exc)
        return found

    # ---------------------------------------------------------------- on the event loop thread
    def apply(self, found: dict[str, str | None]) -> tuple[list[str], list[str]]:
        """Add new replicas and remove vanished ones (or moved ones: same name, new url).
        Returns (added urls, removed urls)."""
        added, removed = [], []
        for name, url in list(self.known.items()):
            if name in found and found[name] in (None, url):
                continue
            del self.known[name]
            worker = self.registry.get(url)
            if worker is not None and worker.source == "ray":
                self.on_remove(url)
                removed.append(url)
        for name, url in found.items():
            if url is not None and name not in self.known:
                self.known[name] = url
                worker = self.registry.get(url)
                if worker is None:
                    self.registry.add(url, source="ray")
                    added.append(url)
                elif worker.source == "static":
                    worker.source = "ray"  # Ray knows it by name now: follow it when it moves
        for url in added:
            log.info("discovered worker %s", url)
        for url in removed:
            log.info("worker %s left the Ray cluster", url)
        return added, removed

    async def poll_once(self) -> tuple[list[str], list[str]]:
        found = await asyncio.to_thread(self.discover)
        return self.apply(found)

    async def run(self) -> None:
        """Poll forever (cancel the task to stop); a failed poll is logged and retried."""
        while True:
            try:
                await self.poll_once()
            except Exception as exc:
                log.warning("Ray discovery failed: %s", exc)
            await asyncio.sleep(self.config.discovery_interval)

    # ------------------------------------------------------------------------- Ray defaults
    def _ensure_ray(self):
        # Ray's native failure-signal handler would take SIGTERM from uvicorn's graceful
        # shutdown (Ray connects after uvicorn installed its handlers): it dumped a stack and
        # aborted the router 3 s later, cutting every in-flight request. Ray reads this when
        # it is first imported. Its "SIGTERM handler is not set" (ray.init off the main
        # thread) is what the router wants, not worth a warning at every start.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        import ray  # lazily: the router without --ray-address never loads Ray

        if not ray.is_initialized():
            logging.getLogger("ray._private.worker").addFilter(
                lambda record: "SIGTERM handler is not set" not in record.getMessage())
            ray.init(address=self.config.ray_address, namespace=self.config.ray_namespace,
                     log_to_driver=False, logging_level=logging.WARNING)
        return ray

    def _ray_lister(self):
        ray = self._ensure_ray()
        return ray.util.list_named_actors(all_namespaces=True)

    def _ray_url_of(self, name: str, namespace: str) -> str:
        ray = self._ensure_ray()
        actor = ray.get_actor(name, namespace=namespace)
        return ray.get(actor.get_url.remote(), timeout=10)
