"""A replica's failures as an operator meets them: a rank killed mid-request, a rank killed while
idle, the replica's head process killed. Each time the replica must come back by itself, and
while it restarts every generation request (streamed too) must get a 503 the router can retry
elsewhere."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from helpers import wait_healthy
from radixray.router.retry import is_restarting

pytestmark = pytest.mark.ray
PROMPT = list(range(40, 90))


def _sampling(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _cache_epoch(url: str) -> str:
    """The epoch the router reads off every answer; a new one tells it the cache is empty."""
    from radixray.router.config import CACHE_EPOCH_HEADER

    return httpx.get(f"{url}/health", timeout=30).headers[CACHE_EPOCH_HEADER]


def _live_placement_groups() -> int:
    from ray.util import placement_group_table

    return sum(e["state"] != "REMOVED" for e in placement_group_table().values())


@pytest.fixture(scope="module")
def replica(ray_session, tiny_llama_path):
    import ray

    from radixray.cluster.replica import start_replica
    from radixray.cluster.tp_worker import free_port

    actor = start_replica("failures", tiny_llama_path, {"max_total_tokens": 2048}, tp_size=1,
                          port=free_port(), step_timeout_s=20)
    url = ray.get(actor.get_url.remote())
    yield actor, url
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def test_streams_to_a_restarting_replica_are_503s(replica):
    """A stream's 200 goes out before the engine is asked; during a restart that turned into an
    in-band error, which the router cannot retry on another replica."""
    import ray

    actor, url = replica
    wait_healthy(url, 90, interval=0.5)
    pids = ray.get(actor.info.remote())["worker_pids"]
    body = {"input_ids": PROMPT, "sampling_params": _sampling(1500), "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as live:
        events = live.iter_lines()
        assert next(e for e in events if e.startswith("data:"))  # it is decoding
        os.kill(pids[0], signal.SIGKILL)
        last = [e for e in events if e.startswith("data:")][-2]  # then [DONE]
    assert '"type": "abort"' in last and '"status_code": 503' in last, last
    # the replica now restarts its rank (seconds: a fresh process loads the model)
    streamed = {
        "/generate": {"input_ids": PROMPT, "sampling_params": _sampling(4), "stream": True},
        "/v1/completions": {"prompt": "def f(x):", "max_tokens": 4, "stream": True},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4, "stream": True},
    }
    for path, body in streamed.items():
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert "restarting" in r.text and is_restarting(r.status_code, r.headers)
    wait_healthy(url, 90, interval=0.5)
    r = httpx.post(f"{url}/generate", timeout=30,
                   json={"input_ids": PROMPT, "sampling_params": _sampling(4), "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert "error" not in r.text


def test_rank_killed_while_idle_restarts_the_replica(replica):
    """With tp=1 there is no peer loop to watch: a rank that died between requests went unseen
    until the next request failed on it."""
    import ray

    actor, url = replica
    wait_healthy(url, 90, interval=0.5)
    before, epoch = ray.get(actor.info.remote()), _cache_epoch(url)
    os.kill(before["worker_pids"][0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # no request is sent: the supervisor must notice
        after = ray.get(actor.info.remote())
        if after["restarts"] > before["restarts"] and after["healthy"]:
            break
        time.sleep(0.5)
    assert after["restarts"] == before["restarts"] + 1 and after["healthy"], after
    assert set(after["worker_pids"]).isdisjoint(before["worker_pids"])
    assert _cache_epoch(url) != epoch  # a fresh, empty cache
    r = httpx.post(f"{url}/generate", timeout=30,
                   json={"input_ids": PROMPT, "sampling_params": _sampling(4), "stream": True})
    assert r.status_code == 200 and "error" not in r.text


def _restart_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("radixray:") and "restarts_total" in line}
    return values["radixray:engine_restarts_total"], values["radixray:head_restarts_total"]


def test_killed_head_comes_back_on_its_port(replica):
    """The head holds the scheduler and the HTTP server; Ray restarts it when its process dies,
    and it serves again at the same URL (the router's static --worker-urls stay valid). Its
    restart counts go on (they started from 0 again, and no metric counted head restarts)."""
    import ray

    actor, url = replica
    wait_healthy(url, 90, interval=0.5)
    live_groups, epoch = _live_placement_groups(), _cache_epoch(url)
    before = ray.get(actor.info.remote())
    head = before["pid"]
    # (the earlier tests killed ranks: their count must survive the head's restart)
    assert _restart_counters(url) == (before["restarts"], before["head_restarts"])
    # SIGTERM, not SIGKILL: Ray's handler used to leave the head half-dead (serving HTTP,
    # refusing actor calls) and never restarted it
    os.kill(head, signal.SIGTERM)
    deadline, info = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        try:
            info = ray.get(actor.info.remote(), timeout=30)
            if info["pid"] != head and info["healthy"]:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # the call raced the death; the next one waits for the restarted actor
        time.sleep(0.5)
    assert info.get("pid") not in (None, head) and info["url"] == url, info
    wait_healthy(url, 90, interval=0.5)
    out = httpx.post(f"{url}/generate", timeout=30,
                     json={"input_ids": PROMPT, "sampling_params": _sampling(4)})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
    assert _cache_epoch(url) != epoch
    assert (info["restarts"], info["head_restarts"]) == (before["restarts"],
                                                         before["head_restarts"] + 1)
    assert _restart_counters(url) == (info["restarts"], info["head_restarts"])
    # Ray keeps a restarted actor's placement groups: the new head removes its predecessor's,
    # else its bundles stay reserved and, on a full node, the new ranks never fit
    assert _live_placement_groups() == live_groups
