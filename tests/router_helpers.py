"""Fake workers and a router served in threads, for the router tests that need real HTTP
(``servers``, the fixture that stops them, is in conftest.py)."""

import socket
import subprocess
import sys
import time

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


def metric(client, sample: str) -> float:
    """The value of one sample of the router's /metrics (``name`` or ``name{labels}``), 0 if
    absent (a counter never incremented has no sample)."""
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


def wait_until(condition, seconds: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def dead_url() -> str:
    """A URL where nothing listens (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def spawn_fake(*flags):
    """A fake worker in its own process (router/fake_worker.py flags); (process, url)."""
    proc = subprocess.Popen([sys.executable, "-m", "radixray.router.fake_worker", "--port", "0",
                             *flags], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"
