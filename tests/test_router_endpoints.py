"""The router's own endpoints and admission, over HTTP: a client leaving the admission queue,
/flush_cache with a worker gone, and the /liveness and /readiness probes."""

import concurrent.futures

import httpx
import pytest

from router_helpers import dead_url, metric, start_fakes, start_router, wait_until


def test_a_client_that_leaves_the_queue_gives_its_place_up(servers):
    fakes, urls = start_fakes(servers, 1)
    fakes[0].delay = 2.0
    client, router = start_router(servers, urls, max_concurrent_requests=1, queue_size=1,
                                  queue_timeout=30)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/generate", json={"text": "holds the one slot"})
        assert wait_until(lambda: router.admission.active == 1, 2)
        with pytest.raises(httpx.TimeoutException):  # queued, then it hangs up
            httpx.post(client.base_url.join("/generate"), json={"text": "impatient"},
                       timeout=0.3)
        # its place is free at once, not when the slot frees (2 s) or the queue times out
        assert wait_until(lambda: router.admission.waiting == 0, 1)
        fakes[0].delay = 0.0
        r = client.post("/generate", json={"text": "takes the free place"})
        assert r.status_code == 200  # queued, then served: no 429 for a gone client's place
        assert first.result().status_code == 200
    assert fakes[0].requests == 2  # the one that left never reached a worker
    assert metric(client, 'radixray_router:requests_total{route="/generate",status="499"}') == 1
    assert router.admission.active == 0


def test_flush_cache_with_a_worker_gone_is_a_502_that_takes_it_out(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    client.post("/generate", json={"text": "something to forget"})
    gone = dead_url()
    assert client.post("/workers", json={"url": gone}).status_code == 201
    r = client.post("/flush_cache")
    assert r.status_code == 502
    error = r.json()["error"]  # the route's error shape, not a plain-text 400
    assert error["code"] == 502 and f"flush failed on {gone}: ConnectError" in error["message"]
    assert fakes[0].flushes == 1 and router.tree.tenants() == []  # the live one flushed
    assert not router.registry.get(gone).healthy  # nothing listens there: out, as the proxy does
    assert client.post("/flush_cache").status_code == 200


def test_flush_cache_passes_a_workers_own_error_on_in_the_error_shape(servers):
    fakes, urls = start_fakes(servers, 2)
    for fake in fakes:
        fake.api_key = "k"
    client, router = start_router(servers, urls)
    r = client.post("/flush_cache")
    assert r.status_code == 401 and "Missing or invalid API key" in r.json()["error"]["message"]
    assert all(w.healthy for w in router.registry.all())


def test_liveness_whatever_the_workers_readiness_while_one_is_healthy(servers):
    fakes, urls = start_fakes(servers, 1)
    # with the cluster's key set: the probes are open, as /health is (the kubelet has no key)
    client, router = start_router(servers, urls, worker_api_key="k")
    assert client.get("/workers").status_code == 401
    for path in ("/liveness", "/readiness", "/health"):
        assert client.get(path).status_code == 200, path
    router.registry.mark_unhealthy(router.registry.get(urls[0]))
    r = client.get("/readiness")
    assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy worker"
    assert client.get("/health").status_code == 503
    assert client.get("/liveness").status_code == 200  # restarting the router cures no worker
    router.remove_worker(urls[0])
    assert client.get("/liveness").status_code == 200
    assert client.post("/liveness").status_code == 405
