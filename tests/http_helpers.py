"""Shared by the HTTP tests: a real uvicorn server on a free loopback port, in a thread, over an
in-process engine running the tiny model."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from transformers import AutoTokenizer

from radixray.cluster.async_engine import InProcessEngine
from radixray.cluster.http_server import ServerArgs, create_app

MODEL_NAME = "tiny"


def make_engine(model_path: str, **server_args) -> InProcessEngine:
    """The tiny model on an 8192-token pool, checking the memory invariant after every step."""
    return InProcessEngine.from_model(model_path, **{"max_total_tokens": 8192,
                                                     "debug_invariants": True, **server_args})


class ServerThread:
    """``with ServerThread(engine, path, **server_args) as url:`` serves until the block ends."""

    def __init__(self, engine, model_path: str, **server_args):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        args = ServerArgs(model_path=model_path, served_model_name=MODEL_NAME, **server_args)
        self.app = create_app(engine, self.tokenizer, args)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serving_fixtures(**server_args):
    """Module-scoped fixtures ``engine`` (the tiny model in process) and ``server`` (HTTP over
    it, with ``server_args``): write ``engine, server = serving_fixtures()`` in a module."""

    @pytest.fixture(scope="module")
    def engine(tiny_llama_path):
        eng = make_engine(tiny_llama_path)
        yield eng
        eng.shutdown()

    @pytest.fixture(scope="module")
    def server(engine, tiny_llama_path):
        srv = ServerThread(engine, tiny_llama_path, **server_args)
        with srv:
            yield srv

    return engine, server


def client_fixture():
    """A per-test fixture ``client``: an httpx client on ``server`` (from serving_fixtures);
    after the test, the scheduler must be idle with its memory invariant holding. Write
    ``client = client_fixture()`` in a module."""

    @pytest.fixture
    def client(server, engine):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c
        wait_idle(engine)

    return client


def wait_idle(engine: InProcessEngine, timeout: float = 10.0) -> None:
    """Wait until the scheduler has no live request, then check its memory invariant."""
    deadline = time.monotonic() + timeout
    while True:
        live = engine.check_invariant()
        if live == 0:
            return
        assert time.monotonic() < deadline, f"{live} requests still live after {timeout}s"
        time.sleep(0.02)


def wait_scheduled(engine: InProcessEngine, rid: str, timeout: float = 10.0) -> None:
    """Wait until the scheduler holds request ``rid``."""
    deadline = time.monotonic() + timeout
    while engine.call_sync(lambda s: rid not in s.live):
        assert time.monotonic() < deadline, f"{rid} never reached the scheduler"
        time.sleep(0.01)


def sse_events(lines) -> list:
    """Parse an SSE body (an iterable of lines): the JSON payloads, then "[DONE]" if sent."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def post_stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())
