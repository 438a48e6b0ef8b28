"""The router's HTTP app (Starlette): SGLang's API in front, workers behind.

Generation routes (/generate, /v1/completions, /v1/chat/completions) go through admission control
and the routing policy; info routes go to any available worker; /flush_cache and /abort_request
go to every healthy worker, whatever its circuit breaker says (a worker whose circuit is open still
runs requests to abort and holds a cache to flush).
/workers manages the worker set at run time, /metrics exposes Prometheus metrics, /health says
whether any worker is healthy. No torch, and no other radixray folder, is imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .admin import admin_routes
from .admission import Admission, Rejected
from .config import CACHE_EPOCH_HEADER, RouterConfig
from .health import HealthChecker
from .metrics import EXPOSITION_CONTENT_TYPE, RouterMetrics
from .policies import RequestInfo, make_policy
from .proxy import Proxy, downstream_headers, error_response, upstream_headers
from .disconnect import until_disconnect
from .request import BadRequest, request_text, routing_key
from .tree import ApproxRadixTree
from .workers import WorkerRegistry

log = logging.getLogger("radixray.router")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
INFO_ROUTES = ("/get_model_info", "/model_info", "/get_server_info", "/server_info",
               "/v1/models", "/v1/models/{model:path}", "/health_generate",
               "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")


class Router:
    """All router state. The HTTP client, admission control and background tasks are created in
    ``start()`` (they belong to the serving event loop)."""

    def __init__(self, config: RouterConfig, discovery_lister=None, discovery_url_of=None):
        self.config = config
        self.rng = random.Random(config.seed)
        self.tree = ApproxRadixTree(config.max_tree_size)
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(config)
        self.registry.on_down(self.tree.remove_tenant)
        self.policy = make_policy(config, self.rng, self.tree)
        for url in config.worker_urls:
            self.registry.add(url, source="static")
        self.discovery = None
        if config.ray_address or discovery_lister is not None:
            from .discovery import RayDiscovery

            self.discovery = RayDiscovery(config, self.registry, self.remove_worker,
                                          discovery_lister, discovery_url_of)
        self.client: httpx.AsyncClient | None = None
        self.proxy: Proxy | None = None
        self.admission: Admission | None = None
        self._tasks: list[asyncio.Task] = []

    def remove_worker(self, url: str) -> bool:
        """Forget a worker: registry, tree entries, gauges. In-flight requests to it finish."""
        worker = self.registry.remove(url)
        if worker is not None:
            self.metrics.forget_worker(worker.url)
        return worker is not None

    async def start(self) -> None:
        c = self.config
        timeout = httpx.Timeout(c.request_timeout, connect=c.connect_timeout)
        # No cap on connections: admission control is the one limit on concurrency.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.admission = Admission(c.max_concurrent_requests, c.queue_size, c.queue_timeout)
        self.proxy = Proxy(c, self.registry, self.tree, self.policy, self.metrics, self.client,
                           self.rng)
        health = HealthChecker(self.registry, self.client, c)
        self._tasks = [asyncio.create_task(health.check_all()),  # learn the truth right away
                       asyncio.create_task(health.run()),
                       asyncio.create_task(self._sweep_loop())]
        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self.discovery.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.client is not None:
            await self.client.aclose()

    def sweep(self) -> None:
        """Drop tree entries of workers that are gone or unhealthy; re-assert the bound."""
        for tenant in self.tree.tenants():
            worker = self.registry.get(tenant)
            if worker is None or not worker.healthy:
                self.tree.remove_tenant(tenant)
            else:
                self.tree.evict_to(tenant, min(worker.tree_limit or self.config.max_tree_size,
                                               self.config.max_tree_size))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.eviction_interval)
            self.sweep()

    # ------------------------------------------------------------------------------- handlers
    async def generate(self, request: Request) -> Response:
        route = request.url.path
        started = time.perf_counter()
        admitted = False
        finished = False

        def finish(status: int) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - started)
            if admitted:
                self.admission.release()

        # Only a body that cannot be routed is refused here (in the replica's words); any
        # other problem is the replica's to name, so both ports answer alike.
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
            if not isinstance(body, dict):
                raise BadRequest("body: must be a JSON object")
            info = RequestInfo(request_text(body), routing_key(body, request.headers))
        except BadRequest as exc:
            return self._reject(route, 400, str(exc), finish)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nested too deep
            return self._reject(route, 400, f"body: malformed JSON ({exc})", finish)
        try:
            await self.admission.acquire()
        except Rejected as exc:
            return self._reject(route, 429, str(exc), finish)
        admitted = True
        try:
            forward = self.proxy.forward(route, raw, info, request.headers,
                                         body.get("stream") is True, finish)
            answer = await until_disconnect(request, forward)
        except BaseException:
            finish(499)  # cancelled or crashed: free the slot
            raise
        if answer is None:  # the client left before the answer: forward was cancelled
            finish(499)
            return Response(status_code=499)
        return answer

    @staticmethod
    def _reject(route, status, message, finish) -> Response:
        finish(status)
        return error_response(route, status, message)

    async def info(self, request: Request) -> Response:
        return await self.proxy.forward_plain(request.method, request.url.path,
                                              await request.body(), request.headers)

    async def health(self, request: Request) -> Response:
        """Ok while any worker passes its health checks: an open circuit is the breaker's
        judgement of recent requests, and it lets traffic through again on its own (or at the
        worker's next passing check), so the router is not down for it."""
        healthy = self.registry.healthy()
        if healthy:
            return PlainTextResponse(f"ok: {len(healthy)} of {len(self.registry)} workers "
                                     f"healthy, {len(self.registry.available())} available")
        return error_response("/health", 503, "no healthy worker")

    async def flush_cache(self, request: Request) -> Response:
        """Flush every healthy worker; the tree forgets those that flushed."""
        workers = self.registry.healthy()
        if not workers:
            return error_response("/flush_cache", 503, "no healthy worker")

        # The client's headers go along: workers started with --api-key check Authorization.
        headers = upstream_headers(request.headers)

        async def flush(worker):
            try:
                resp = await self.client.post(worker.url + "/flush_cache", headers=headers)
                self.registry.observe_epoch(worker, resp.headers.get(CACHE_EPOCH_HEADER))
                return worker, resp.status_code, resp.text
            except httpx.HTTPError as exc:
                return worker, 502, f"{type(exc).__name__}: {exc}"

        results = await asyncio.gather(*(flush(w) for w in workers))
        failed, unauthorized = [], False
        for worker, status, text in results:
            if status == 200:
                self.tree.remove_tenant(worker.url)
            else:
                unauthorized |= status == 401
                failed.append(f"{worker.url}: HTTP {status} {text.strip()[:200]}")
        if failed:
            return PlainTextResponse("flush failed on " + "; ".join(failed),
                                     status_code=401 if unauthorized else 400)
        return PlainTextResponse(f"Cache flushed on {len(results)} workers.\n")

    async def abort_request(self, request: Request) -> Response:
        """Pass the abort to every healthy worker: the router does not track which worker
        holds a rid, and a worker that does not know it has nothing to abort."""
        raw = await request.body()
        workers = self.registry.healthy()
        if not workers:
            return error_response("/abort_request", 503, "no healthy worker")

        async def abort(worker):
            try:
                resp = await self.client.post(worker.url + "/abort_request", content=raw,
                                              headers=upstream_headers(request.headers))
                return resp.status_code, resp.content, resp.headers
            except httpx.HTTPError as exc:
                return None, f"{worker.url}: {type(exc).__name__}: {exc}".encode(), {}

        results = await asyncio.gather(*(abort(w) for w in workers))
        # A worker unreachable now has nothing running to abort (its health checks will say
        # the rest); only if none answered is the abort itself in doubt.
        answers = [r for r in results if r[0] is not None]
        if not answers:
            return error_response("/abort_request", 502, "no worker answered: " + "; ".join(
                content.decode() for _, content, _ in results))
        failed = next((r for r in answers if r[0] != 200), None)
        if failed is not None:  # a bad body is refused alike by every worker: pass one answer on
            status, content, headers = failed
            return Response(content, status, downstream_headers(headers))
        aborted = set()
        for _, content, _ in answers:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                aborted.update(json.loads(content).get("aborted") or [])
        return JSONResponse({"aborted": sorted(aborted)})

    async def metrics_endpoint(self, request: Request) -> Response:
        body = self.metrics.render(self.registry.all(), self.tree)
        return Response(body, media_type=EXPOSITION_CONTENT_TYPE)


def build_app(config: RouterConfig, router: Router | None = None) -> Starlette:
    """The ASGI app; ``router`` may be passed in to inspect its state (tests, embedding)."""
    router = router or Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [Route(path, router.generate, methods=["POST"]) for path in GENERATION_ROUTES]
    routes += [Route(path, router.info, methods=["GET", "POST"]) for path in INFO_ROUTES]
    routes += [
        Route("/health", router.health, methods=["GET"]),
        # GET too: a replica (cluster/http_server.py) and SGLang accept both
        Route("/flush_cache", router.flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", router.abort_request, methods=["POST"]),
        Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        *admin_routes(router),
    ]

    async def no_such_route(request: Request, exc: HTTPException) -> Response:
        # 404 / 405 in the replica's error shape (OpenAI's on /v1/...)
        return error_response(request.url.path, exc.status_code, exc.detail, exc.headers)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: no_such_route})
    app.state.router = router
    return app
