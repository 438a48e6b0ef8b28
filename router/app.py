"""The router's HTTP app (Starlette): SGLang's API in front, workers behind.

Generation routes (/generate, /v1/completions, /v1/chat/completions) go through admission control
and the routing policy; info routes go to any available worker; /flush_cache and /abort_request
go to every healthy worker, whatever its circuit breaker says (a worker whose circuit is open still
runs requests to abort and holds a cache to flush).
/workers manages the worker set at run time, /metrics exposes Prometheus metrics, /health and
/readiness say whether any worker is healthy, /liveness that the router itself runs. No torch,
and no other radixray folder, is imported here.
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .admin import admin_routes
from .admission import Admission, Rejected
from .bodies import Offloader, PayloadTooLarge, read_body
from .config import CACHE_EPOCH_HEADER, RouterConfig
from .health import HealthChecker
from .helper import HelperDied
from .metrics import EXPOSITION_CONTENT_TYPE, RouterMetrics
from .policies import make_policy
from .headers import downstream_headers, upstream_headers
from .proxy import Proxy, error_response
from .disconnect import until_disconnect
from .request import BadRequest, read_request
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
        self.offload = Offloader()
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
                           self.rng, self.offload)
        self.offload.start()  # in the background: the first large body finds its helper up
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
        await self.offload.aclose()

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

        # Only a body too large or that cannot be routed is refused here (in the replica's
        # words); any other problem is the replica's to name, so both ports answer alike.
        try:
            raw = await read_body(request, self.config.max_payload_size)
            info = await self.offload.run(len(raw), read_request, raw,
                                          request.headers.get("x-routing-key"),
                                          route == "/generate")
        except PayloadTooLarge as exc:
            return self._reject(route, 413, exc.detail, finish)
        except BadRequest as exc:
            return self._reject(route, 400, str(exc), finish)
        except HelperDied as exc:  # most likely out of memory: not parsed again in the router
            return self._reject(route, 503, str(exc), finish)
        except ClientDisconnect:  # left while sending the body
            finish(499)
            return Response(status_code=499)
        try:
            # A client that leaves while queued gives its place up at once (None: it left,
            # and the cancelled acquire took no slot).
            admitted = await until_disconnect(request, self.admission.acquire()) is True
        except Rejected as exc:
            return self._reject(route, 429, str(exc), finish)
        if not admitted:
            finish(499)
            return Response(status_code=499)
        try:
            forward = self.proxy.forward(route, raw, info, request.headers, finish)
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
        finish(status)  # a 429 is load: say when to come back (OpenAI's clients read it)
        return error_response(route, status, message,
                              {"Retry-After": "1"} if status == 429 else None)

    async def info(self, request: Request) -> Response:
        raw = await read_body(request, self.config.max_payload_size)
        return await self.proxy.forward_plain(request.method, request.url.path, raw,
                                              request.headers)

    async def health(self, request: Request) -> Response:
        """/health and /readiness: ok while any worker passes its health checks. An open
        circuit is the breaker's judgement of recent requests, and it lets traffic through
        again on its own (or at the worker's next passing check), so the router is not down
        for it."""
        healthy = self.registry.healthy()
        if healthy:
            return PlainTextResponse(f"ok: {len(healthy)} of {len(self.registry)} workers "
                                     f"healthy, {len(self.registry.available())} available")
        return error_response(request.url.path, 503, "no healthy worker")

    async def liveness(self, request: Request) -> Response:
        """Ok whenever this answers at all (the process and its event loop run), whatever the
        workers' state: a liveness probe restarts the router, which cures no worker."""
        return PlainTextResponse("ok")

    def _unreachable(self, worker, exc: httpx.HTTPError) -> str:
        """A request of the router's own to ``worker`` failed: as the proxy does, a refused
        connection takes the worker out until a health check passes. The failure, in words."""
        if isinstance(exc, httpx.ConnectError):
            self.registry.mark_unhealthy(worker)
        return f"{type(exc).__name__}: {exc}"

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
            except httpx.HTTPError as exc:
                return worker, None, self._unreachable(worker, exc)
            self.registry.observe_epoch(worker, resp.headers.get(CACHE_EPOCH_HEADER))
            return worker, resp.status_code, f"HTTP {resp.status_code} {resp.text.strip()[:200]}"

        results = await asyncio.gather(*(flush(w) for w in workers))
        failed, statuses = [], []
        for worker, status, text in results:
            if status == 200:
                self.tree.remove_tenant(worker.url)
            else:
                failed.append(f"{worker.url}: {text}")
                statuses.append(status or 502)  # 502: no answer from it
        if failed:
            # The workers' own status, the lowest first: a client error (a missing API key)
            # is what the caller can act on.
            return error_response("/flush_cache", min(statuses),
                                  "flush failed on " + "; ".join(failed))
        return PlainTextResponse(f"Cache flushed on {len(results)} workers.\n")

    async def abort_request(self, request: Request) -> Response:
        """Pass the abort to every healthy worker: the router does not track which worker
        holds a rid, and a worker that does not know it has nothing to abort."""
        raw = await read_body(request, self.config.max_payload_size)
        workers = self.registry.healthy()
        if not workers:
            return error_response("/abort_request", 503, "no healthy worker")

        async def abort(worker):
            try:
                resp = await self.client.post(worker.url + "/abort_request", content=raw,
                                              headers=upstream_headers(request.headers))
                return resp.status_code, resp.content, resp.headers
            except httpx.HTTPError as exc:
                return None, f"{worker.url}: {self._unreachable(worker, exc)}".encode(), {}

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
        Route("/readiness", router.health, methods=["GET"]),  # SGLang's gateway names
        Route("/liveness", router.liveness, methods=["GET"]),
        # GET too: a replica (cluster/http_server.py) and SGLang accept both
        Route("/flush_cache", router.flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", router.abort_request, methods=["POST"]),
        Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        *admin_routes(router),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # 404 / 405 / 413 in the replica's error shape (OpenAI's on /v1/...); a bare "Not
        # Found" left a client of /v1/embeddings guessing whether the model was the problem
        detail = (f"Not Found: {request.url.path} is not an endpoint of this server"
                  if exc.status_code == 404 and exc.detail == "Not Found" else exc.detail)
        return error_response(request.url.path, exc.status_code, detail, exc.headers)

    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # It left while sending its body (read_body, on any route): its own doing, no error
        # to log with a traceback, and nobody to read the answer (499, as /generate, which
        # also counts it, answers).
        return Response(status_code=499)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, ClientDisconnect: client_left})
    app.state.router = router
    return app
