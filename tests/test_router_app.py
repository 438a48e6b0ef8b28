"""The router over HTTP, in front of fake SGLang-compatible workers served by uvicorn in threads:
routing, streaming pass-through, admission, bad input, runtime worker management, metrics."""

import concurrent.futures
import json
import time

import httpx
import pytest

from radixray.router.app import Router, build_app
from radixray.router.config import RouterConfig
from radixray.router.fake_worker import FakeWorker, serve_in_thread

SYSTEM = "You are a helpful assistant for tenant {0}. Follow the policy document closely. " * 6


@pytest.fixture
def make_cluster():
    servers = []

    def make(n_workers=2, worker_kw=None, **config_kw):
        fakes = [FakeWorker(f"w{i}", **(worker_kw or {})) for i in range(n_workers)]
        worker_servers = [serve_in_thread(f.app) for f in fakes]
        servers.extend(worker_servers)
        config_kw.setdefault("health_check_interval", 60.0)
        config = RouterConfig(worker_urls=[s.url for s in worker_servers], seed=0, **config_kw)
        router = Router(config)
        server = serve_in_thread(build_app(config, router))
        servers.append(server)
        client = httpx.Client(base_url=server.url, timeout=20)
        return client, router, fakes, [s.url for s in worker_servers]

    yield make
    for server in servers:
        server.stop_nowait()
    for server in servers:
        server.join()


def worker_of(resp) -> str:
    return resp.json()["meta_info"]["worker"]


def metric(client, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " ") or line.startswith(line_start + "{") and \
                line.split(" ")[0] == line_start:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_shared_prefixes_stick_to_one_worker_and_groups_spread(make_cluster):
    client, router, fakes, urls = make_cluster(3)
    owner = {}
    for turn in range(4):
        for group in range(6):
            r = client.post("/generate", json={"text": SYSTEM.format(group) + f"question {turn}",
                                               "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200
            owner.setdefault(group, set()).add(worker_of(r))
    assert all(len(ws) == 1 for ws in owner.values()), owner
    assert len(set.union(*owner.values())) >= 2  # new groups are misses: spread, not piled
    real = metric(client, "radixray_router:real_cache_hit_rate")
    predicted = metric(client, "radixray_router:predicted_cache_hit_rate")
    assert real > 0.6 and abs(real - predicted) < 0.05


def test_miss_goes_to_least_loaded_worker(make_cluster):
    client, router, fakes, urls = make_cluster(3)
    router.registry.get(urls[0]).load = 3  # crafted in-flight loads
    router.registry.get(urls[1]).load = 1
    r = client.post("/generate", json={"text": "a prompt nobody has seen"})
    assert worker_of(r) == "w2"
    router.registry.get(urls[0]).load = 0
    router.registry.get(urls[1]).load = 0


@pytest.mark.parametrize("route,body,has_usage", [
    ("/generate", {"text": "stream me please", "stream": True}, True),
    ("/v1/completions", {"prompt": "stream me please", "stream": True}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "stream me"}],
                              "stream": True, "stream_options": {"include_usage": True}}, True),
])
def test_streaming_is_byte_equal_to_a_direct_request_and_unbuffered(make_cluster, route, body,
                                                                     has_usage):
    client, router, fakes, urls = make_cluster(1, worker_kw={"chunk_delay": 0.05})
    direct = httpx.post(urls[0] + route, json=body, timeout=10)
    httpx.post(urls[0] + "/flush_cache")  # same cache state for the routed request
    prompt_tokens_before = metric(client, "radixray_router:real_prompt_tokens_total")
    arrivals, chunks = [], []
    start = time.perf_counter()
    with client.stream("POST", route, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for chunk in resp.iter_raw():
            arrivals.append(time.perf_counter() - start)
            chunks.append(chunk)
    assert b"".join(chunks) == direct.content
    assert direct.content.endswith(b"data: [DONE]\n\n")
    # 8 chunks, 50 ms apart: the first reached the client long before the last was produced
    assert len(chunks) >= 4 and arrivals[0] < arrivals[-1] - 0.2
    # the final event's usage/meta_info (when the stream has one) fed the real hit-rate counters
    time.sleep(0.1)  # the router settles its accounts just after the last byte
    grew = metric(client, "radixray_router:real_prompt_tokens_total") > prompt_tokens_before
    assert grew == has_usage


def test_client_disconnect_cancels_the_upstream_stream(make_cluster):
    client, router, fakes, urls = make_cluster(1, worker_kw={"chunk_delay": 0.1,
                                                              "output_len": 100})
    with client.stream("POST", "/generate", json={"text": "long one", "stream": True}) as resp:
        next(resp.iter_raw())
    assert wait_until(lambda: fakes[0].cancelled_streams == 1, 5)
    assert_slots_released(router, urls[0])
    # counted as cancelled (499), not as the 200 that went out with the first byte
    assert wait_until(lambda: metric(
        client, 'radixray_router:requests_total{route="/generate",status="499"}') == 1.0, 5)
    assert metric(client, 'radixray_router:requests_total{route="/generate",status="200"}') == 0


def wait_until(condition, seconds: float) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def assert_slots_released(router, url):
    """The router's load count and admission slot for a finished or cancelled request."""
    assert wait_until(lambda: not (router.registry.get(url).load or router.admission.active), 2)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_before_the_answer_cancels_the_upstream_request(make_cluster, stream):
    # The worker takes 3 s to answer; the client gives up after 0.3 s. The router must close
    # its upstream request at once (so a real worker aborts it and frees its KV), not wait.
    client, router, fakes, urls = make_cluster(1, worker_kw={"delay": 3.0})
    with pytest.raises(httpx.TimeoutException):
        httpx.post(client.base_url.join("/generate"), timeout=0.3,
                   json={"text": "slow one", "stream": stream})
    assert wait_until(lambda: fakes[0].cancelled_requests == 1, 1.5)
    assert_slots_released(router, urls[0])


def test_no_worker_gives_503_with_a_clear_message(make_cluster):
    client, router, fakes, urls = make_cluster(1)
    client.delete(f"/workers/{urls[0]}")
    r = client.post("/generate", json={"text": "hi"})
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["object"] == "error"
    assert client.get("/health").status_code == 503


def test_a_header_value_past_ascii_is_passed_on(make_cluster):
    """`User-Agent: café` (valid HTTP: a latin-1 byte) made httpx raise on the decoded text:
    every proxied route answered a plain-text 500."""
    client, router, fakes, urls = make_cluster(1)
    agent = {"user-agent": "café/1.0".encode("latin-1")}
    r = client.post("/generate", json={"text": "x"}, headers=agent)
    assert r.status_code == 200, r.text
    with client.stream("POST", "/v1/completions", headers=agent, json={
            "model": "m", "prompt": "x", "stream": True}) as s:
        assert s.status_code == 200 and s.read().endswith(b"data: [DONE]\n\n")
    assert client.post("/flush_cache", headers=agent).status_code == 200


def test_429_beyond_max_concurrency_and_queue(make_cluster):
    client, router, fakes, urls = make_cluster(1, worker_kw={"delay": 0.3},
                                               max_concurrent_requests=2, queue_size=1,
                                               queue_timeout=10)

    def one(i):
        r = client.post("/generate", json={"text": f"request {i}"})
        # a 429 says when to come back (OpenAI's clients wait that long before retrying)
        assert (r.headers.get("retry-after") == "1") == (r.status_code == 429)
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = sorted(pool.map(one, range(6)))
    assert codes == [200, 200, 200, 429, 429, 429]
    assert fakes[0].requests == 3
    r = client.post("/generate", json={"text": "later"})
    assert r.status_code == 200  # slots were all given back


@pytest.mark.parametrize("route,content,message", [
    ("/generate", b"{not json", "body: malformed JSON (Expecting property name"),
    ("/generate", b"[1, 2]", "body: must be a JSON object"),
    ("/generate", b"", "body: must be a JSON object"),
    ("/v1/chat/completions", b'"hi"', "body: must be a JSON object"),
    ("/generate", b"\xff\xfe", "body: malformed JSON"),
])
def test_an_unroutable_body_is_400_without_touching_a_worker(make_cluster, route, content,
                                                             message):
    client, router, fakes, urls = make_cluster(1)
    r = client.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    payload = r.json()
    error = payload if route.startswith("/v1/") else payload["error"]
    assert error["message"].startswith(message)  # worded as a replica words it
    assert error["param"] == "body"
    if route.startswith("/v1/"):
        assert payload["object"] == "error" and payload["type"] == "BadRequestError"
    assert fakes[0].requests == 0


@pytest.mark.parametrize("route,body", [
    ("/generate", {"text": 5}), ("/generate", {"input_ids": ["a"]}),
    ("/generate", {"input_ids": [-1]}), ("/generate", {"text": "x", "session_id": [1]}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [None, {"role": "user", "content": 3}]}),
    ("/v1/completions", {"prompt": [1 << 40]}),
])
def test_a_routable_bad_body_goes_to_a_worker_which_names_the_problem(make_cluster, route,
                                                                      body):
    client, router, fakes, urls = make_cluster(1)
    fakes[0].fail_status = 400  # what a replica says of such a body
    r = client.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == "w0 failing on purpose"
    assert fakes[0].requests == 1


def test_unknown_routes_and_methods_answer_in_the_error_shape(make_cluster):
    client, router, fakes, urls = make_cluster(1)
    r = client.get("/v1/nonexistent")
    assert r.status_code == 404 and r.json() == {
        "object": "error", "message": "Not Found: /v1/nonexistent is not an endpoint of this "
        "server", "type": "NotFoundError", "param": None, "code": 404}
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["type"] == "MethodNotAllowedError" and r.json()["code"] == 405
    r = client.post("/nowhere")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Not Found: /nowhere is not an endpoint of this "
                                  "server", "code": 404, "param": None}}
    # /v1/models/{model} is not unknown: forwarded (the fake worker has no such route)
    r = client.get("/v1/models/some/model")
    assert r.status_code == 404 and r.text == "Not Found"  # the worker's plain answer
    assert fakes[0].requests == 0


def test_client_errors_from_a_worker_pass_through_unretried(make_cluster):
    client, router, fakes, urls = make_cluster(2, policy="round_robin")
    fakes[0].fail_status = fakes[1].fail_status = 400
    r = client.post("/generate", json={"text": "x"})
    assert r.status_code == 400
    assert fakes[0].requests + fakes[1].requests == 1


def test_workers_added_and_removed_at_run_time(make_cluster):
    client, router, fakes, urls = make_cluster(2)
    extra = FakeWorker("w9")
    extra_server = serve_in_thread(extra.app)
    try:
        assert client.post("/workers", json={"url": extra_server.url}).status_code == 201
        assert client.post(f"/workers?url={extra_server.url}/").status_code == 200  # known
        r = client.post("/workers", json={"url": "localhost:1"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("url")
        assert len(client.get("/workers").json()["workers"]) == 3
        for i in range(15):
            client.post("/generate", json={"text": f"tenant {i} " * 20})
        assert extra.requests > 0 and router.tree.size(extra_server.url) > 0
        assert client.delete(f"/workers/{extra_server.url}").status_code == 200
        assert extra_server.url not in router.tree.tenants()
        assert router.tree.size(extra_server.url) == 0
        assert extra_server.url not in client.get("/metrics").text.split("worker_load")[1][:2000]
        before = extra.requests
        for i in range(6):
            assert client.post("/generate", json={"text": f"tenant {i} " * 20}).status_code == 200
        assert extra.requests == before
        assert client.delete("/workers/http://nobody:1").status_code == 404
    finally:
        extra_server.stop()


def test_info_routes_and_flush_cache(make_cluster):
    client, router, fakes, urls = make_cluster(2)
    assert client.get("/get_model_info").json()["model_path"] == "fake/model"
    assert "max_total_num_tokens" in client.get("/get_server_info").json()
    assert client.get("/health").status_code == 200
    for i in range(6):
        client.post("/generate", json={"text": f"group {i} " * 10})
    assert router.tree.tenants()
    r = client.post("/flush_cache")
    assert r.status_code == 200
    assert router.tree.tenants() == []
    assert all(f.cache.tenants() == [] for f in fakes)


def test_flush_cache_passes_the_clients_api_key_on(make_cluster):
    client, router, fakes, urls = make_cluster(2, worker_kw={"api_key": "k"})
    assert client.post("/flush_cache").status_code == 401
    r = client.post("/flush_cache", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200, r.text


def test_abort_request_reaches_every_worker(make_cluster):
    # The router does not know which worker runs a rid, so every worker hears the abort.
    client, router, fakes, urls = make_cluster(2)
    r = client.post("/abort_request", json={"rid": "r-1"})
    assert r.status_code == 200 and r.json() == {"aborted": ["r-1"]}
    assert [f.aborted for f in fakes] == [["r-1"], ["r-1"]]
    bad = client.post("/abort_request", content=b"{nope")
    assert bad.status_code == 400 and "rid" in bad.json()["error"]["message"]


def test_health_checks_take_a_worker_out_and_back(make_cluster):
    client, router, fakes, urls = make_cluster(2, health_check_interval=0.1,
                                               health_failure_threshold=2)
    for i in range(8):
        client.post("/generate", json={"text": f"prefix {i} " * 10})
    fakes[0].health_status = 503
    deadline = time.monotonic() + 5
    while router.registry.get(urls[0]).healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not router.registry.get(urls[0]).healthy
    assert router.tree.size(urls[0]) == 0  # its predicted cache is forgotten
    before = fakes[0].requests
    for i in range(8):
        assert client.post("/generate", json={"text": f"prefix {i} " * 10}).status_code == 200
    assert fakes[0].requests == before
    assert metric(client, f'radixray_router:worker_healthy{{worker="{urls[0]}"}}') == 0.0
    fakes[0].health_status = 200
    while not router.registry.get(urls[0]).healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router.registry.get(urls[0]).healthy


@pytest.mark.parametrize("noticed_by", ["answer", "health_check"])
def test_a_worker_restart_between_health_checks_empties_its_tree(make_cluster, noticed_by):
    """A replica that restarts (or is flushed) between two health checks comes back with an
    empty cache; its next answer, or its next health check, carries a new cache epoch."""
    interval = 0.1 if noticed_by == "health_check" else 60.0
    client, router, fakes, urls = make_cluster(2, health_check_interval=interval)
    first, second = SYSTEM.format(0) + "first question", SYSTEM.format(0) + "second question"
    owner = worker_of(client.post("/generate", json={"text": first}))
    assert worker_of(client.post("/generate", json={"text": second})) == owner
    url = urls[int(owner[1:])]
    assert router.tree.size(url) > len(SYSTEM.format(0))
    fakes[int(owner[1:])].restart()
    if noticed_by == "answer":
        r = client.post("/generate", json={"text": first})  # still predicted there: goes there
        assert worker_of(r) == owner and r.json()["meta_info"]["cached_tokens"] == 0
        # the tree forgot everything but the request just served
        assert router.tree.match(second).chars_for(url) == len(SYSTEM.format(0))
        assert router.tree.match(first).chars_for(url) == len(first)
    else:
        deadline = time.monotonic() + 5
        while router.tree.size(url) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert router.tree.size(url) == 0
    assert router.registry.get(url).healthy  # a restart is not a failure


@pytest.mark.parametrize("api_key", [None, "secret"])
def test_each_workers_tree_bound_follows_its_kv_capacity(make_cluster, api_key):
    # workers with an API key answer /get_server_info to the router's own key only
    client, router, fakes, urls = make_cluster(2, worker_kw={"cache_chars": 3000,
                                                             "api_key": api_key},
                                               tree_chars_per_token=2.0,
                                               worker_api_key=api_key)
    deadline = time.monotonic() + 5  # the first health check reads /get_server_info
    while any(router.registry.get(u).tree_limit is None for u in urls) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None  # the cluster's key
    workers = client.get("/workers", headers=auth).json()["workers"]
    assert [w["tree_limit"] for w in workers] == [6000, 6000]
    for i in range(40):
        client.post("/generate", json={"text": f"{i:04d} unique prompt " * 20})
    assert all(0 < router.tree.size(u) <= 6000 for u in urls)


def test_metrics_expose_the_documented_names(make_cluster):
    client, router, fakes, urls = make_cluster(2)
    client.post("/generate", json={"text": "one"})
    client.post("/v1/completions", json={"prompt": "two"})
    text = client.get("/metrics").text
    names = ["requests_total", "errors_total", "retries_total", "policy_decisions_total",
             "predicted_cached_chars_total", "request_chars_total", "real_cached_tokens_total",
             "real_prompt_tokens_total", "worker_load", "worker_healthy", "circuit_state",
             "tree_size_chars", "predicted_cache_hit_rate", "real_cache_hit_rate",
             "request_duration_seconds_bucket"]
    for name in names:
        assert f"# TYPE radixray_router:{name.removesuffix('_bucket')}" in text.replace(
            "_total counter", " counter") or f"radixray_router:{name}" in text, name
    assert 'radixray_router:requests_total{route="/generate",status="200"} 1.0' in text
    assert 'radixray_router:policy_decisions_total{decision="cache_miss",policy="cache_aware"}' \
        in text
    assert metric(client, "radixray_router:request_chars_total") == len("one") + len("two")
    body = json.dumps(client.get("/workers").json())
    assert all(u in body for u in urls)
