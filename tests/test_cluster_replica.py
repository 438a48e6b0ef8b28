"""Ray replicas end to end: tp=2 replica equals HF over HTTP, survives a killed rank, and two
replicas in one Ray cluster serve independently and are discoverable by name; a replica bound to
a wildcard address advertises its node and runs its head beside rank 0."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from hf_reference import hf_greedy

pytestmark = pytest.mark.ray
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300, 400], list(range(40, 90))]


def _generate(url: str, ids: list[int], max_new_tokens: int, timeout: float = 60) -> dict:
    r = httpx.post(f"{url}/generate", timeout=timeout, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                              "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tp2_replica(ray_session, tiny_llama_path):
    import ray

    from radixray.cluster.replica import start_replica

    actor = start_replica("tp2", tiny_llama_path, {"max_total_tokens": 2048,
                                                   "debug_invariants": True},
                          tp_size=2, step_timeout_s=20)
    yield actor, ray.get(actor.get_url.remote())
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def test_tp2_replica_matches_hf_over_http(tp2_replica, tiny_llama_path):
    import ray

    actor, url = tp2_replica
    for ids in PROMPTS:
        out = _generate(url, ids, 8)
        assert out["output_ids"] == hf_greedy(tiny_llama_path, ids, 8)
    assert ray.get(actor.check_invariant.remote()) == 0


def test_head_and_ranks_freeze_their_startup_heap(tp2_replica):
    """A full collection over the ~400k objects start-up made held the GIL for 0.27-1.2 s,
    stalling decode steps; each process of a replica freezes them (heap.py). The head freezes
    before it builds its engine: a frozen scheduler or radix tree is never collected (a
    restart or a flush replaces them), nor anything in a cycle with it."""
    import ray

    actor, _ = tp2_replica
    frozen = ray.get(actor.info.remote())["gc_frozen_objects"]
    assert frozen["head"] > 50_000 and len(frozen["ranks"]) == 2, frozen
    assert all(n > 50_000 for n in frozen["ranks"]), frozen
    assert not ray.get(actor.engine_is_frozen.remote())


def test_killed_rank_aborts_inflight_then_replica_recovers(tp2_replica, tiny_llama_path):
    import ray

    actor, url = tp2_replica
    before = ray.get(actor.info.remote())
    results = []

    def long_request():
        r = httpx.post(f"{url}/generate", timeout=60, json={
            "input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 1500,
                                                         "temperature": 0, "ignore_eos": True}})
        results.append(r)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)  # let it start decoding
    os.kill(before["worker_pids"][1], signal.SIGKILL)
    start = time.monotonic()
    t.join(30)
    assert not t.is_alive(), "in-flight request hung after a rank died"
    assert time.monotonic() - start < 20
    assert results[0].status_code == 503, results[0].text  # retryable: the router retries it
    assert "aborted" in results[0].json()["error"]["message"]

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the replica restarts its ranks and serves again
        if httpx.get(f"{url}/health", timeout=30).status_code == 200:
            break
        time.sleep(0.5)
    after = ray.get(actor.info.remote())
    assert after["restarts"] == before["restarts"] + 1 and after["healthy"]
    assert set(after["worker_pids"]).isdisjoint(before["worker_pids"])
    out = _generate(url, PROMPTS[0], 8)
    assert out["output_ids"] == hf_greedy(tiny_llama_path, PROMPTS[0], 8)
    assert ray.get(actor.check_invariant.remote()) == 0


def test_two_replicas_serve_independently_and_register(ray_session, tiny_qwen2_path):
    import ray

    from radixray.cluster.replica import ACTOR_PREFIX, NAMESPACE, start_replica

    actors = [start_replica(f"pair{i}", tiny_qwen2_path, {"max_total_tokens": 1024})
              for i in range(2)]
    try:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE}
        assert {f"{ACTOR_PREFIX}pair0", f"{ACTOR_PREFIX}pair1"} <= names
        urls = ray.get([a.get_url.remote() for a in actors])
        assert urls[0] != urls[1]
        prompt = list(range(10, 60))
        first = _generate(urls[0], prompt, 4)
        again = _generate(urls[0], prompt, 4)
        other = _generate(urls[1], prompt, 4)
        assert first["output_ids"] == other["output_ids"] == hf_greedy(tiny_qwen2_path, prompt, 4)
        # each replica has its own radix cache: only the replica that saw the prompt hits it
        assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
        assert other["meta_info"]["cached_tokens"] == 0
        assert ray.get([a.check_invariant.remote() for a in actors]) == [0, 0]
    finally:
        for a in actors:
            ray.get(a.shutdown.remote())
            ray.kill(a)


def test_prometheus_scrapes_real_replica_and_router(tp2_replica, tmp_path):
    """A real Prometheus server scrapes the running replica and a router in front of it."""
    import shutil
    import socket

    import uvicorn

    from radixray.router.app import build_app
    from radixray.router.config import RouterConfig
    from test_deploy_prometheus import scrape_and_query

    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus package is not installed")
    _, url = tp2_replica
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(RouterConfig(port=port, worker_urls=(url,))),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        router_url = f"http://127.0.0.1:{port}"
        for _ in range(2):
            _generate(router_url, PROMPTS[1], 4)
        results = scrape_and_query(tmp_path, [url.split("//")[1], f"127.0.0.1:{port}"], [
            'radixray:num_requests_total{replica="tp2"}',
            "radixray:prompt_tokens_total",
            'radixray_router:requests_total{route="/generate"}',
        ])
        served = float(results['radixray:num_requests_total{replica="tp2"}'][0]["value"][1])
        assert served >= 2
        routed = sum(float(r["value"][1])
                     for r in results['radixray_router:requests_total{route="/generate"}'])
        assert routed >= 2
    finally:
        server.should_exit = True
        thread.join(10)


def test_wildcard_replica_advertises_its_node_and_sits_with_rank_zero(ray_session,
                                                                     tiny_qwen2_path):
    """Bound to 0.0.0.0 the replica advertises its node's IP (0.0.0.0 would send the router to
    itself); its head runs on the node of its rank 0's bundle; that placement group is kept
    while ranks restart and released by shutdown."""
    import ray
    from ray.util import placement_group_table
    from ray.util.placement_group import PlacementGroup

    from radixray.cluster.replica import NAMESPACE, pg_name, start_replica
    from radixray.cluster.tp_worker import free_port
    from radixray.cluster.worker_group import bundle_node_id

    def reserved():
        return [e for e in placement_group_table().values()
                if e["name"] == pg_name(NAMESPACE, "anyhost") and e["state"] != "REMOVED"]

    port = free_port()
    actor = start_replica("anyhost", tiny_qwen2_path, {"max_total_tokens": 512, "device": "auto"},
                          host="0.0.0.0", port=port)
    try:
        url = ray.get(actor.get_url.remote())
        assert url == f"http://{ray.util.get_node_ip_address()}:{port}"  # 127.0.0.1 in tests
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        info = ray.get(actor.info.remote())
        (entry,) = reserved()
        pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(entry["placement_group_id"])))
        assert info["node_id"] == bundle_node_id(pg, 0)
        server_info = httpx.get(f"{url}/get_server_info", timeout=10).json()
        # the effective device, never "auto"
        has_gpu = ray.cluster_resources().get("GPU", 0) >= 1
        assert server_info["device"] == ("cuda" if has_gpu else "cpu")

        os.kill(info["worker_pids"][0], signal.SIGKILL)  # ranks restart in the same bundles
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = ray.get(actor.info.remote())
            if after["restarts"] > info["restarts"] and after["healthy"]:
                break
            time.sleep(0.5)
        assert after["restarts"] == info["restarts"] + 1 and after["healthy"], after
        assert [e["placement_group_id"] for e in reserved()] == [entry["placement_group_id"]]
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    assert reserved() == []
