"""Failure handling end to end: retries move requests off failing workers, the circuit breaker
opens and closes, and a worker killed mid-load (a real process, SIGKILL) costs no client a hang."""

import concurrent.futures
import os
import signal
import threading
import time

import pytest

from helpers import wait_healthy
from router_helpers import spawn_fake, start_fakes, start_router

from radixray.router.circuit import CLOSED


def dead_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


def metrics_text(client) -> str:
    return client.get("/metrics").text


@pytest.mark.parametrize("status", [500, 503])
def test_retry_moves_a_request_off_a_failing_worker(servers, status):
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls, policy="round_robin")
    fakes[0].fail_status = status
    for i in range(4):
        r = client.post("/generate", json={"text": f"hello {i}"})
        assert r.status_code == 200 and r.json()["meta_info"]["worker"] == "w1"
    # each retry takes a round-robin turn, so every request started on the failing worker
    assert fakes[0].requests == 4
    text = metrics_text(client)
    assert f'radixray_router:retries_total{{worker="{urls[0]}"}} 4.0' in text
    assert f'radixray_router:errors_total{{kind="http_{status}",worker="{urls[0]}"}} 4.0' in text


def test_retry_moves_off_a_refused_connection_and_marks_the_worker_down(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, policy="round_robin")
    gone = dead_url()
    assert client.post("/workers", json={"url": gone}).status_code == 201
    for i in range(4):
        r = client.post("/generate", json={"text": f"hello {i}"})
        assert r.status_code == 200
    assert fakes[0].requests == 4
    worker = router.registry.get(gone)
    assert not worker.healthy and router.tree.size(gone) == 0
    assert f'errors_total{{kind="connect",worker="{gone}"}} 1.0' in metrics_text(client)


def test_when_every_attempt_fails_the_client_gets_the_last_answer_quickly(servers):
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls, max_retries=3)
    for f in fakes:
        f.fail_status = 503
    start = time.perf_counter()
    r = client.post("/generate", json={"text": "doomed"})
    assert r.status_code == 503 and "failing on purpose" in r.text
    assert time.perf_counter() - start < 2
    assert fakes[0].requests + fakes[1].requests == 4  # first try + 3 retries


def test_breaker_opens_then_half_opens_then_closes(servers):
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls, policy="round_robin", max_retries=1,
                                  breaker_failure_threshold=2, breaker_window=30,
                                  breaker_cooldown=0.4, breaker_success_threshold=1)
    state = f'radixray_router:circuit_state{{worker="{urls[0]}"}}'
    fakes[0].fail_status = 500
    for i in range(2):
        assert client.post("/generate", json={"text": f"a {i}"}).status_code == 200
    assert fakes[0].requests == 2
    assert f"{state} 1.0" in metrics_text(client)  # open
    for i in range(4):
        assert client.post("/generate", json={"text": f"b {i}"}).status_code == 200
    assert fakes[0].requests == 2  # no traffic while open
    fakes[0].fail_status = None
    time.sleep(0.45)
    assert f"{state} 2.0" in metrics_text(client)  # half-open after the cool-down
    for i in range(3):
        assert client.post("/generate", json={"text": f"c {i}"}).status_code == 200
    assert fakes[0].requests >= 3  # the trial went through
    assert f"{state} 0.0" in metrics_text(client)  # closed again


def test_a_request_every_worker_answers_500_opens_no_circuit(servers):
    """A request that triggers a bug answers 500 on every worker. Each attempt counted against
    its worker's breaker, so three such requests (each tried on all workers) opened every
    circuit, and everyone got 503s (found by a fuzzer). A 500 now counts only once another
    worker has answered the same request: then the worker, not the request, failed it."""
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls, policy="round_robin", max_retries=3,
                                  breaker_failure_threshold=3)
    state = 'radixray_router:circuit_state{{worker="{}"}}'
    for f in fakes:
        f.fail_status = 500
    for i in range(5):
        assert client.post("/generate", json={"text": f"poison {i}"}).status_code == 500
    assert fakes[0].requests + fakes[1].requests == 20  # each tried 4 times: 500s are retried
    text = metrics_text(client)
    assert all(f"{state.format(u)} 0.0" in text for u in urls)  # every circuit closed
    fakes[1].fail_status = None  # now only w0 fails: its 500s are its own
    for i in range(6):
        assert client.post("/generate", json={"text": f"fine {i}"}).status_code == 200
    assert f"{state.format(urls[0])} 1.0" in metrics_text(client)  # open
    assert f"{state.format(urls[1])} 0.0" in metrics_text(client)


def test_a_500_then_an_answer_from_the_same_worker_is_no_failure(servers):
    """With one worker the retry goes to the same one: its 500 followed by its own 200 was
    booked as its failure (a half-open circuit re-opened right after the success)."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, max_retries=2, breaker_failure_threshold=2)
    for _ in range(3):
        fakes[0].fail_status, fakes[0].fail_next = 500, 1
        assert client.post("/generate", json={"text": "x"}).status_code == 200
    assert router.registry.get(urls[0]).breaker.state == CLOSED


def test_worker_killed_mid_load_no_client_hangs(servers, processes):
    spawned = [spawn_fake("--delay", "0.02", "--name", f"p{i}") for i in range(3)]
    processes.extend(p for p, _ in spawned)
    urls = [u for _, u in spawned]
    for (proc, u) in spawned:  # wait until every process serves
        wait_healthy(u, 20, lambda: proc.poll() is None, interval=0.05)
    client, router = start_router(servers, urls, health_check_interval=0.5)
    done = []
    lock = threading.Lock()
    killed = threading.Event()

    def one(i):
        start = time.perf_counter()
        r = client.post("/generate", json={"text": f"group {i % 30} system prompt " * 8 + str(i)})
        with lock:
            done.append(i)
            if len(done) == 40 and not killed.is_set():
                spawned[0][0].send_signal(signal.SIGKILL)
                killed.set()
        return r.status_code, time.perf_counter() - start, r.json()["meta_info"]["worker"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(160)))
    assert killed.is_set()
    assert [s for s, _, _ in results] == [200] * 160
    assert max(t for _, t, _ in results) < 5.0
    assert {w for _, _, w in results[-40:]} <= {"p1", "p2"}
    assert router.registry.get(urls[0]).served > 0  # it did take load before it died
    errors = [line for line in metrics_text(client).splitlines()
              if line.startswith("radixray_router:errors_total{") and urls[0] in line]
    assert errors  # the router saw it fail (connection reset or refused) and moved on
    assert not router.registry.get(urls[0]).healthy
    assert router.tree.size(urls[0]) == 0


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event(servers, processes):
    proc, url = spawn_fake("--chunk-delay", "0.05", "--output-len", "200")
    processes.append(proc)
    client, router = start_router(servers, [url])
    with client.stream("POST", "/generate", json={"text": "x", "stream": True}) as resp:
        chunks = resp.iter_raw()
        first = next(chunks)
        assert first.startswith(b"data: ")
        os.kill(proc.pid, signal.SIGKILL)
        start = time.perf_counter()
        rest = b"".join(chunks)
    assert time.perf_counter() - start < 5
    assert b'"error"' in rest and b"failed mid-stream" in rest
    # ended as the replica ends its own in-band errors: a typed error, then [DONE]
    assert rest.endswith(b"data: [DONE]\n\n") and b'"type": "BadGatewayError"' in rest
    deadline = time.monotonic() + 2  # the router settles its accounts just after the last byte
    while router.admission.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert router.registry.get(url).load == 0 and router.admission.active == 0
