"""Request bodies: --max-payload-size (413 in the route's error shape, from Content-Length before
the body is read, or while reading one without it), a client leaving mid-upload (a quiet 499),
and large bodies and answers parsed in helper processes (test_router_helper.py tests those on
their own): a body that kills its helper is a 503, and no client waits for an answer's token
counts."""

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from radixray.router import app as app_module
from radixray.router import proxy as proxy_module
from radixray.router.app import build_app
from radixray.router.bodies import LARGE_BODY_BYTES
from radixray.router.config import RouterConfig
from router_helpers import metric, start_fakes, start_router, wait_until
from test_router_helper import SLOW_ANSWER_S, read_request_or_die, slow_answer_facts

P = "radixray_router:"


def test_a_body_over_the_limit_is_a_413_in_the_routes_shape(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, max_payload_size=1000)
    big = json.dumps({"text": "x" * 1000}).encode()
    r = client.post("/generate", content=big)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["param"] == "body" and "limit of 1000 bytes" in error["message"]
    r = client.post("/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["type"] == "PayloadTooLargeError"

    def chunked():  # no Content-Length: counted while read
        yield big[:600]
        yield big[600:]

    assert client.post("/generate", content=chunked()).status_code == 413
    for path in ("/tokenize", "/abort_request", "/workers"):
        assert client.post(path, content=big).status_code == 413, path
    assert fakes[0].requests == 0 and fakes[0].aborted == []
    assert metric(client, P + 'requests_total{route="/generate",status="413"}') == 2
    assert client.post("/generate", json={"text": "x" * 900}).status_code == 200  # <= 1000


def test_a_declared_length_over_the_limit_is_refused_before_the_body_comes(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, max_payload_size=1 << 20)
    host, port = urlsplit(str(client.base_url)).hostname, urlsplit(str(client.base_url)).port
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000\r\n\r\n{\"text\": ")
        answer = sock.recv(65536)  # never sends the gigabyte: the answer must not wait for it
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_large_batch_is_routed_on_its_first_prompt_and_counted(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    prompts = [f"prompt number {i:05d} " * 4 for i in range(2000)]
    body = json.dumps({"text": prompts})
    assert len(body) > LARGE_BODY_BYTES  # request and answer both go through the helper
    r = client.post("/generate", content=body)
    assert r.status_code == 200 and len(r.json()) == len(prompts)
    assert router.tree.match(prompts[0]).chars_for(urls[0]) == len(prompts[0])
    assert wait_until(lambda: metric(client, P + "real_prompt_tokens_total") ==
                      sum(map(len, prompts)))
    r = client.post("/generate", content=body[:-1])  # malformed: 400 in the replica's words
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("body: malformed JSON (Expecting")




@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/tokenize", "/abort_request",
                                  "/workers", "/add_worker"])
def test_a_client_leaving_mid_upload_is_a_quiet_499(path):
    app = build_app(RouterConfig(worker_urls=[]))
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"content-length", b"100")],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 30000)}
    asyncio.run(app(scope, receive, send))  # a 500 re-raises its exception here, after logging
    assert sent[0]["status"] == 499


def test_a_body_whose_helper_dies_under_it_is_a_503_in_the_routes_shape(servers, monkeypatch):
    # most likely killed for its memory: parsed again in the router, it could kill the router
    monkeypatch.setattr(app_module, "read_request", read_request_or_die)
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    big = "x" * LARGE_BODY_BYTES
    r = client.post("/generate", json={"text": big})
    assert r.status_code == 503 and "died" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": big})
    assert r.status_code == 503 and r.json()["code"] == 503
    assert metric(client, P + 'requests_total{route="/generate",status="503"}') == 1
    assert fakes[0].requests == 0
    assert client.post("/generate", json={"text": "small"}).status_code == 200  # inline


def test_a_large_answer_goes_out_before_its_token_counts_are_read(servers, monkeypatch):
    monkeypatch.setattr(proxy_module, "answer_facts", slow_answer_facts)
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    prompts = [f"p{i:05d}" for i in range(3000)]
    started = time.perf_counter()
    r = client.post("/generate", json={"text": prompts})  # a small body, a large answer
    took = time.perf_counter() - started
    assert r.status_code == 200 and len(r.content) > LARGE_BODY_BYTES
    assert took < SLOW_ANSWER_S - 1, took
    assert wait_until(lambda: metric(client, P + "real_prompt_tokens_total") ==
                      sum(map(len, prompts)), 30 + SLOW_ANSWER_S)
