"""Fake workers and a router served in threads, for the router tests that need real HTTP
(``servers``, the fixture that stops them, is in conftest.py)."""

import httpx

from radixray.router.app import Router, build_app
from radixray.router.config import RouterConfig
from radixray.router.fake_worker import FakeWorker, serve_in_thread


def start_router(servers, urls, **config_kw):
    config_kw.setdefault("health_check_interval", 60.0)
    config_kw.setdefault("retry_initial_backoff", 0.01)
    config = RouterConfig(worker_urls=urls, seed=0, **config_kw)
    router = Router(config)
    server = serve_in_thread(build_app(config, router))
    servers.append(server)
    return httpx.Client(base_url=server.url, timeout=20), router


def start_fakes(servers, n):
    fakes = [FakeWorker(f"w{i}") for i in range(n)]
    urls = []
    for fake in fakes:
        server = serve_in_thread(fake.app)
        servers.append(server)
        urls.append(server.url)
    return fakes, urls
