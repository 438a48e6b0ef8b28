"""A replica restarting behind the router, and the circuit breaker around it: a replica's
"restarting" 503s are no breaker failures, a new engine gets a closed circuit, half-open admits
concurrent requests, and the router's /health, /flush_cache and /abort_request reach healthy
workers whatever their circuit says."""

import concurrent.futures
import time

import pytest

from radixray.router.circuit import CLOSED, HALF_OPEN, OPEN
from radixray.router.config import RESTARTING_HEADER, RouterConfig
from radixray.router.retry import is_restarting
from radixray.router.workers import WorkerRegistry
from router_helpers import start_fakes, start_router


def wait_until(condition, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def settled(router) -> None:
    """Wait for the router's first health checks (a late one would undo a test's marks)."""
    assert wait_until(lambda: all(w.server_info_read for w in router.registry.all()))


def open_circuit(client, router, fake, url):
    """Fail requests on ``fake`` until its circuit opens; then let it answer well again. (A 503
    without the restarting marker: a 500 counts only once another worker answers.)"""
    fake.fail_status = 503
    while router.registry.get(url).breaker.state != OPEN:
        client.post("/generate", json={"text": "fail"})
    fake.fail_status = None


def test_the_restarting_marker_is_the_replicas_header():
    assert is_restarting(503, {RESTARTING_HEADER: "1"})
    assert not is_restarting(500, {RESTARTING_HEADER: "1"})  # only the 503 the replica sends
    # a crash, or another server's overload, with the replica's words but not its header
    assert not is_restarting(503, {"content-type": "application/json"})


@pytest.mark.parametrize("gate, route, body", [
    (True, "/generate", {"text": "hello"}),
    (True, "/generate", {"text": "hello", "stream": True}),
    (True, "/v1/completions", {"model": "m", "prompt": "hello", "stream": True}),
    (True, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    # without the gate: the engine went away after the gate let the request in (a stream
    # would have sent its 200 by then, which is why the gate exists)
    (False, "/generate", {"text": "hello"}),
    (False, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_replica_without_an_engine_sends_the_marker(tiny_llama_path, gate, route, body):
    """Both ways a restarting replica answers. The real app, the real tokenizer; only the engine
    is missing."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from radixray.cluster.http_server import ServerArgs, create_app
    from radixray.cluster.engine_slot import RestartGate, SwappableEngine

    engine = SwappableEngine()  # no engine yet, as between a rank's death and its new engine
    app = create_app(engine, AutoTokenizer.from_pretrained(tiny_llama_path),
                     ServerArgs(model_path=tiny_llama_path, served_model_name="m"))
    client = TestClient(RestartGate(app, engine) if gate else app)
    r = client.post(route, json=body)
    assert r.status_code == 503 and "replica is restarting" in r.text
    assert is_restarting(r.status_code, r.headers)
    assert not is_restarting(client.get("/health").status_code, client.get("/health").headers)
    flush = client.post("/flush_cache")  # was a 500 "internal error: EngineRestarting"
    assert flush.status_code == 503 and is_restarting(flush.status_code, flush.headers)


@pytest.mark.parametrize("route, body", [
    ("/generate", {"text": "hello"}),
    ("/generate", {"text": "hello", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_a_restarting_replica_is_unavailable_not_broken(servers, route, body):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, health_check_interval=0.3)
    settled(router)
    worker = router.registry.get(urls[0])
    fakes[0].restarting = True
    r = client.post(route, json=body)
    assert r.status_code == 503 and "replica is restarting" in r.text  # the replica's words
    assert fakes[0].requests == 1  # no retries hammering it: it is out until a check passes
    assert not worker.healthy
    for _ in range(3):  # the probe: 3 client requests with retries opened the circuit
        r = client.post(route, json=body)
        assert r.status_code == 503 and "no healthy worker" in r.text and "unhealthy" in r.text
    assert worker.breaker.state == CLOSED
    assert 'errors_total{kind="restarting"' in client.get("/metrics").text
    old_epoch = worker.cache_epoch
    fakes[0].restart()
    fakes[0].restarting = False
    assert wait_until(lambda: worker.healthy)
    assert worker.cache_epoch != old_epoch
    assert client.post(route, json=body).status_code == 200


def test_requests_move_off_a_restarting_replica_to_another(servers):
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls, policy="round_robin")
    settled(router)
    fakes[0].restarting = True
    for i in range(6):
        r = client.post("/generate", json={"text": f"hello {i}"})
        assert r.status_code == 200 and r.json()["meta_info"]["worker"] == "w1"
    assert fakes[0].requests == 1
    assert router.registry.get(urls[0]).breaker.state == CLOSED


def half_open_router(servers, cooldown: float):
    """One fake worker behind a router whose breaker (2 failures open it, 100 successes close
    it) has just opened; the worker answers well again."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, breaker_failure_threshold=2,
                                  breaker_cooldown=cooldown, breaker_success_threshold=100)
    open_circuit(client, router, fakes[0], urls[0])
    return fakes[0], client, router.registry.get(urls[0]).breaker


def test_half_open_admits_concurrent_requests(servers):
    # One replica whose circuit is half-open: 7 of 8 concurrent requests used to get an
    # immediate 503 while the single trial ran.
    fake, client, breaker = half_open_router(servers, cooldown=0.3)
    fake.delay = 0.3
    assert wait_until(lambda: breaker.state == HALF_OPEN)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(
            lambda i: client.post("/generate", json={"text": f"q {i}"}).status_code, range(8)))
    assert statuses == [200] * 8
    assert breaker.state == HALF_OPEN  # 8 successes of the 100 it needs


def test_a_new_engine_gets_a_closed_circuit(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, health_check_interval=0.1,
                                  breaker_failure_threshold=2, breaker_cooldown=60,
                                  breaker_success_threshold=100)
    worker = router.registry.get(urls[0])
    open_circuit(client, router, fakes[0], urls[0])
    # a passing check of the same engine: half-open, not closed (the breaker is for workers
    # that pass checks and fail requests)
    assert wait_until(lambda: worker.breaker.state == HALF_OPEN)
    time.sleep(0.3)
    assert worker.breaker.state == HALF_OPEN
    fakes[0].restart()  # a fresh engine: the next check carries its cache epoch
    assert wait_until(lambda: worker.breaker.state == CLOSED)


def test_an_answer_from_a_new_engine_closes_the_circuit(servers):
    fake, client, breaker = half_open_router(servers, cooldown=0.2)
    assert wait_until(lambda: breaker.state == HALF_OPEN)
    assert client.post("/generate", json={"text": "same engine"}).status_code == 200
    assert breaker.state == HALF_OPEN
    fake.restart()
    assert client.post("/generate", json={"text": "new engine"}).status_code == 200
    assert breaker.state == CLOSED


def test_a_flush_is_no_new_engine():
    registry = WorkerRegistry(RouterConfig(breaker_failure_threshold=1))
    worker = registry.add("http://w:1")
    registry.observe_epoch(worker, "a.0")
    worker.breaker.record_failure()
    assert registry.observe_epoch(worker, "a.1")  # flushed: the tree forgets it ...
    assert worker.breaker.state == OPEN  # ... but it is the same engine that failed
    assert registry.observe_epoch(worker, "b.0")
    assert worker.breaker.state == CLOSED


def test_health_flush_and_abort_reach_a_healthy_worker_with_an_open_circuit(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, breaker_failure_threshold=1,
                                  breaker_cooldown=60)
    open_circuit(client, router, fakes[0], urls[0])
    r = client.get("/health")
    assert r.status_code == 200 and "1 of 1 workers healthy, 0 available" in r.text
    r = client.post("/abort_request", json={"rid": "r-1"})
    assert r.status_code == 200 and fakes[0].aborted == ["r-1"]
    flushes = fakes[0].flushes
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/flush_cache").status_code == 200  # as a replica, GET too
    assert fakes[0].flushes == flushes + 2
    r = client.post("/generate", json={"text": "hi"})
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and message.startswith("no available worker: ")
    assert f"{urls[0]} (circuit open: half-open in " in message
    assert message.endswith(" s or at its next passing health check)")


def test_no_worker_message_names_each_workers_state(servers):
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls, breaker_failure_threshold=1,
                                  breaker_cooldown=60, max_retries=0)
    settled(router)
    router.registry.mark_unhealthy(router.registry.get(urls[0]))
    open_circuit(client, router, fakes[1], urls[1])
    message = client.post("/v1/completions", json={"prompt": "hi"}).json()["message"]
    assert message.startswith("no available worker: ")
    assert f"{urls[0]} (unhealthy: no traffic until a health check passes)" in message
    assert f"{urls[1]} (circuit open: half-open in " in message
    router.registry.mark_unhealthy(router.registry.get(urls[1]))
    r = client.post("/generate", json={"text": "hi"})
    assert r.json()["error"]["message"].startswith("no healthy worker: ")
    assert client.get("/health").status_code == 503
