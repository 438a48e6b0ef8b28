"""The router's worker-management routes, and who may call them.

``GET /workers`` lists the workers with their state; ``POST /workers {"url": ...}`` adds one;
``DELETE /workers/{url}`` removes one. SGLang's router names are kept as aliases:
``POST /add_worker?url=``, ``POST /remove_worker?url=``, ``GET /list_workers``
(``{"urls": [...]}``).

A worker added here receives clients' requests (their prompts and Authorization headers) and the
router's own requests with the replicas' API key, so these routes are not open to whoever can
reach the router: with a key (``RADIXRAY_WORKER_API_KEY``, which ``radixray serve --api-key``
sets) they need ``Authorization: Bearer <key>``; without one, only clients on the router's own
machine (loopback: a shell on the node, ``kubectl port-forward``) may call them.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .bodies import read_body
from .circuit import STATE_NAMES
from .proxy import error_response
from .workers import normalize_url


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # not an address (a test client's "testclient")
        return False


def admin_refusal(request: Request, api_key: str | None) -> Response | None:
    """None if ``request`` may manage workers, else the 401/403 to answer."""
    path = request.url.path
    if api_key:
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return error_response(path, 401, "Authorization: managing workers needs "
                              "'Bearer <the cluster's API key>'")
    if request.client is not None and _is_loopback(request.client.host):
        return None
    return error_response(path, 403, "Authorization: without an API key "
                          "(RADIXRAY_WORKER_API_KEY), workers can only be managed from the "
                          "router's own machine")


def admin_routes(router) -> list[Route]:
    """The routes above over ``router`` (a ``router.app.Router``)."""

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            refusal = admin_refusal(request, router.config.worker_api_key)
            return refusal if refusal is not None else await handler(request)
        return endpoint

    async def list_workers(request: Request) -> Response:
        return JSONResponse({"policy": router.policy.name, "workers": [
            {"url": w.url, "source": w.source, "healthy": w.healthy, "available": w.available(),
             "load": w.load, "served": w.served, "circuit": STATE_NAMES[w.breaker.state],
             "tree_chars": router.tree.size(w.url),
             "tree_limit": w.tree_limit or router.config.max_tree_size}
            for w in router.registry.all()]})

    async def list_urls(request: Request) -> Response:
        return JSONResponse({"urls": [w.url for w in router.registry.all()]})

    async def add_worker(request: Request) -> Response:
        """{"url": ...} or ?url=...: 201 when added, 200 when already known."""
        try:
            body = json.loads(await read_body(request, router.config.max_payload_size) or b"{}")
        except (ValueError, RecursionError) as exc:
            return error_response(request.url.path, 400, f"body: malformed JSON ({exc})")
        url = body.get("url") if isinstance(body, dict) else None
        if url is None:
            url = request.query_params.get("url")
        try:
            url = normalize_url(url)
        except ValueError as exc:
            return error_response(request.url.path, 400, str(exc))
        known = url in router.registry
        router.registry.add(url, source="api")
        return JSONResponse({"url": url, "added": not known}, status_code=200 if known else 201)

    async def remove_worker(request: Request) -> Response:
        """DELETE /workers/{url}, or POST /remove_worker?url=..."""
        url = request.path_params.get("url") or request.query_params.get("url")
        try:
            removed = router.remove_worker(url)
        except ValueError as exc:
            return error_response(request.url.path, 400, str(exc))
        if not removed:
            return error_response(request.url.path, 404, f"url: no worker {url!r}")
        return JSONResponse({"url": url.strip().rstrip("/"), "removed": True})

    return [
        Route("/workers", guarded(list_workers), methods=["GET"]),
        Route("/workers", guarded(add_worker), methods=["POST"]),
        Route("/workers/{url:path}", guarded(remove_worker), methods=["DELETE"]),
        Route("/list_workers", guarded(list_urls), methods=["GET"]),
        Route("/add_worker", guarded(add_worker), methods=["POST"]),
        Route("/remove_worker", guarded(remove_worker), methods=["POST"]),
    ]
