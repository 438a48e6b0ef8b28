"""Router building blocks without HTTP: breaker, backoff, admission, request parsing, SSE tail,
token counts, worker registry and Ray discovery (with an injected lister, no Ray)."""

import asyncio
import json
import random
import subprocess
import sys

import pytest

from radixray.router.admission import Admission, Rejected
from radixray.router.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from radixray.router.config import RouterConfig
from radixray.router.discovery import RayDiscovery
from radixray.router.request import (SSETail, answer_counts, copies_per_prompt, request_text,
                                     routing_key, server_error, stream_end, token_counts)
from radixray.router.retry import backoff_delay
from radixray.router.workers import WorkerRegistry, normalize_url


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_router_imports_neither_torch_nor_other_radixray_folders():
    code = ("import sys, radixray.router.app, radixray.router.cli, radixray.router.discovery; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'ray' "
            "or (m.startswith('radixray.') and not m.startswith('radixray.router'))]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class TestBreaker:
    def test_opens_after_threshold_within_window_only(self):
        clock = Clock()
        b = CircuitBreaker(failure_threshold=3, window=10, cooldown=5, success_threshold=2,
                           clock=clock)
        b.record_failure()
        clock.t += 11  # the first failure leaves the window
        b.record_failure()
        b.record_failure()
        assert b.state == CLOSED and b.allows()
        b.record_failure()
        assert b.state == OPEN and not b.allows()

    def test_half_open_admits_every_request_and_successes_close_it(self):
        # No single-trial slot: with one, a one-replica deployment refused all but one
        # concurrent request for as long as the trial ran.
        clock = Clock()
        b = CircuitBreaker(failure_threshold=1, window=10, cooldown=5, success_threshold=2,
                           clock=clock)
        b.record_failure()
        clock.t += 4.9
        assert b.state == OPEN and not b.allows() and b.cooldown_left() == pytest.approx(0.1)
        clock.t += 0.2
        assert b.state == HALF_OPEN and b.allows() and b.cooldown_left() == 0
        b.record_success()
        assert b.state == HALF_OPEN and b.allows()
        b.record_success()
        assert b.state == CLOSED

    def test_a_passing_health_check_ends_the_cool_down_and_counts_as_a_success(self):
        clock = Clock()
        b = CircuitBreaker(failure_threshold=1, window=10, cooldown=60, success_threshold=2,
                           clock=clock)
        b.probe_passed()  # closed: nothing to do
        assert b.state == CLOSED
        b.record_failure()
        clock.t += 1
        b.probe_passed()
        assert b.state == HALF_OPEN and b.allows()
        b.record_failure()  # still failing real requests: open for a full cool-down again
        assert b.state == OPEN
        b.probe_passed()
        b.probe_passed()  # an idle worker's circuit closes on health checks alone
        assert b.state == HALF_OPEN
        b.probe_passed()
        assert b.state == CLOSED

    def test_failure_while_half_open_reopens_and_reset_closes(self):
        clock = Clock()
        b = CircuitBreaker(failure_threshold=2, window=10, cooldown=5, success_threshold=1,
                           clock=clock)
        b.record_failure()
        b.record_failure()
        clock.t += 5
        assert b.state == HALF_OPEN
        b.record_failure()
        assert b.state == OPEN
        clock.t += 4
        assert b.state == OPEN
        b.reset()  # a new engine behind the URL
        assert b.state == CLOSED and b.allows()
        b.record_failure()  # the old engine's failures are forgotten: one is not enough
        assert b.state == CLOSED


def test_backoff_grows_caps_and_jitters():
    config = RouterConfig(retry_initial_backoff=0.1, retry_backoff_multiplier=2.0,
                          retry_max_backoff=0.5, retry_jitter=0.2)
    rng = random.Random(0)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (9, 0.5)]:
        delays = [backoff_delay(attempt, config, rng) for _ in range(200)]
        assert base * 0.8 - 1e-9 <= min(delays) < base * 0.9
        assert base * 1.1 < max(delays) <= base * 1.2 + 1e-9


def test_admission_queues_then_rejects():
    async def scenario():
        adm = Admission(max_concurrent=2, queue_size=1, queue_timeout=0.2)
        await adm.acquire()
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        with pytest.raises(Rejected, match="capacity"):
            await adm.acquire()  # queue full
        adm.release()
        await asyncio.wait_for(waiter, 1)  # the queued request got the freed slot
        assert adm.active == 2
        with pytest.raises(Rejected, match="waited"):
            await adm.acquire()  # queued, but nobody releases in time
        assert adm.waiting == 0

    asyncio.run(scenario())


def test_admission_unlimited():
    async def scenario():
        adm = Admission(max_concurrent=0, queue_size=0, queue_timeout=1)
        for _ in range(1000):
            await adm.acquire()
        assert adm.active == 1000

    asyncio.run(scenario())


class TestRequestText:
    def test_sources(self):
        assert request_text({"text": "hello"}) == "hello"
        assert request_text({"text": ["first", "second"]}) == "first"
        assert request_text({"prompt": "p"}) == "p"
        assert request_text({"prompt": [1, 2]}) == "\x01\x02"
        msgs = [{"role": "system", "content": "be nice"},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {}}]}]
        assert request_text({"messages": msgs}) == "be nice\nhi"
        assert request_text({"input_ids": [104, 105]}) == "hi"
        assert request_text({"input_ids": [[104], [105]]}) == "h"
        assert request_text({"sampling_params": {}}) == ""

    @pytest.mark.parametrize("body,text", [
        # the replica names what is wrong with these; the router routes on what it can read
        ({"text": 5}, ""), ({"input_ids": [104, "x", 105]}, "h"),
        ({"input_ids": [-1]}, ""), ({"prompt": [104, 1 << 40]}, "h"),
        ({"prompt": [True]}, ""), ({"messages": "hi"}, ""), ({"messages": [None]}, ""),
        ({"messages": [{"role": "user", "content": 3}, {"role": "user", "content": "b"}]}, "b"),
        ({"prompt": {"a": 1}}, ""), ({"input_ids": "hi"}, ""),
    ])
    def test_odd_fields_route_on_what_can_be_read(self, body, text):
        assert request_text(body) == text

    def test_routing_key(self):
        assert routing_key({"routing_key": "r"}, {"x-routing-key": "h"}) == "h"
        assert routing_key({"routing_key": "r", "session_id": "s"}, {}) == "r"
        assert routing_key({"session_id": 7}, {}) == "7"
        assert routing_key({}, {}) is None
        assert routing_key({"session_id": [1]}, {}) is None  # no key; not the router's to refuse
        assert routing_key({"routing_key": True, "session_id": "s"}, {}) == "s"


def test_token_counts_from_both_apis():
    native = {"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 7}}
    openai = {"usage": {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 5}}}
    assert token_counts(native) == (7, 10)
    assert token_counts(openai) == (5, 20)
    assert token_counts({"usage": {"prompt_tokens": 4, "prompt_tokens_details": None}}) == (0, 4)
    assert token_counts([native, native]) == (14, 20)
    assert token_counts({"usage": None}) is None
    assert token_counts("nope") is None


def sse_bytes(events) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_sse_tail_finds_the_last_event_whatever_the_chunking(split):
    events = [{"text": "a" * i, "meta_info": {"prompt_tokens": 9, "cached_tokens": i}}
              for i in range(1, 6)]
    stream = sse_bytes(events)
    tail = SSETail()
    for i in range(0, len(stream), split):
        tail.feed(stream[i:i + split])
    assert list(tail.last_events) == [None]
    assert stream_end(tail.last_events, 1) == ((5, 9), None)


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_sse_tail_keeps_the_last_event_of_each_answer_of_a_batch(split):
    # a native batch stream interleaves its answers' events, ``index`` last in each (SGLang
    # writes it without spaces); every answer's last event counts, not only the stream's
    def event(index, cached):
        return {"text": "x", "meta_info": {"prompt_tokens": 10 + index, "cached_tokens": cached,
                                           "note": '"index": 9}'}, "index": index}
    events = [event(0, 1), event(1, 1), event(0, 2), event(2, 5), event(1, 3)]
    stream = sse_bytes(events[:4]).removesuffix(b"data: [DONE]\n\n")
    stream += f"data: {json.dumps(events[4], separators=(',', ':'))}\n\n".encode()
    tail = SSETail()
    for i in range(0, len(stream), split):
        tail.feed(stream[i:i + split])
    assert sorted(tail.last_events) == [0, 1, 2]
    assert stream_end(tail.last_events, 1) == ((2 + 3 + 5, 10 + 11 + 12), None)
    # n = 2: copies 0 and 1 of the first prompt, 2 (and 3) of the second; one count per prompt
    assert stream_end(tail.last_events, 2) == ((2 + 5, 10 + 12), None)


def test_copies_per_prompt_of_native_n():
    assert copies_per_prompt({"text": "a"}) == 1
    assert copies_per_prompt({"text": ["a", "b"], "sampling_params": {"n": 1}}) == 1
    assert copies_per_prompt({"text": ["a", "b"], "sampling_params": {"n": 3}}) == 3
    assert copies_per_prompt({"input_ids": [[1], [2], [3]],
                              "sampling_params": [{"n": 2}, {}, {"n": 3}]}) == (2, 1, 3)
    assert copies_per_prompt({"text": ["a", "b"], "sampling_params": [{}, None]}) == 1
    for bad in ({"n": 0}, {"n": "2"}, [{"n": 2}, {"n": True}], "x"):  # the replica refuses
        assert copies_per_prompt({"text": ["a", "b"], "sampling_params": bad}) == 1


def test_answer_counts_count_each_prompt_once():
    def result(prompt, cached):
        return {"meta_info": {"prompt_tokens": prompt, "cached_tokens": cached}}
    batch = json.dumps([result(7, 2), result(7, 2), result(5, 1), result(5, 1)]).encode()
    assert answer_counts(batch, 1) == (6, 24)
    assert answer_counts(batch, 2) == (3, 12)
    assert answer_counts(batch, (2, 2)) == (3, 12)
    uneven = json.dumps([result(7, 2), result(5, 1), result(5, 1), result(5, 1)]).encode()
    assert answer_counts(uneven, (1, 3)) == (3, 12)  # prompt 0 once, prompt 1 three times
    assert answer_counts(batch, 3) == (6, 24)  # not the layout asked for: count every one
    assert answer_counts(json.dumps(result(7, 2)).encode(), 1) == (2, 7)
    assert answer_counts(b"not json", 1) is None


@pytest.mark.parametrize("event,status", [
    ({"meta_info": {"finish_reason": {"type": "abort", "message": "x", "status_code": 503}}},
     503),
    ({"meta_info": {"finish_reason": {"type": "abort", "message": "by request"}}}, None),
    ({"meta_info": {"finish_reason": {"type": "abort", "status_code": 400}}}, None),
    ({"meta_info": {"finish_reason": {"type": "length", "length": 3}}}, None),
    ({"error": {"message": "request aborted: x", "type": "InternalServerError", "code": 500}},
     500),
    ({"error": {"message": "bad", "code": 400}}, None),
    ({"object": "error", "message": "x", "code": 503}, 503),
    ({"choices": [], "usage": None}, None), ("text", None),
])
def test_server_errors_reported_in_band(event, status):
    assert server_error(event) == status


def test_normalize_url():
    assert normalize_url(" http://h:1/ ") == "http://h:1"
    # a port that is no number was accepted, then every request to it was a 500; a lone
    # surrogate was stored and broke /workers and /metrics for good
    for bad in ("", "h:1", "ftp://h", None, 3, "http://127.0.0.1:80x", "http://h\udc80:1",
                "http://:80"):
        with pytest.raises(ValueError, match="^url"):
            normalize_url(bad)


def test_registry_down_listeners_fire_on_remove_and_on_turning_unhealthy():
    registry = WorkerRegistry(RouterConfig())
    down = []
    registry.on_down(down.append)
    a = registry.add("http://a:1")
    assert registry.add("http://a:1/") is a
    registry.add("http://b:1")
    registry.mark_unhealthy(a)
    registry.mark_unhealthy(a)  # no second notice
    assert [w.url for w in registry.available()] == ["http://b:1"]
    registry.mark_healthy(a)
    assert len(registry.available()) == 2
    registry.remove("http://b:1")
    assert down == ["http://a:1", "http://b:1"]
    assert registry.remove("http://zzz:1") is None


def test_discovery_adds_and_removes_replicas():
    registry = WorkerRegistry(RouterConfig())
    registry.add("http://static:1")
    actors = [{"name": "replica:0", "namespace": "radixray"},
              {"name": "replica:1", "namespace": "radixray"},
              {"name": "replica:2", "namespace": "other"},  # wrong namespace
              {"name": "engine:0", "namespace": "radixray"},  # wrong prefix
              {"name": "replica:static", "namespace": "radixray"}]
    urls = {"replica:0": "http://r0:1", "replica:1": "http://r1:1",
            "replica:static": "http://static:1"}
    broken = set()

    def url_of(name, namespace):
        if name in broken:
            raise RuntimeError("actor not ready")
        return urls[name]

    removed = []

    def on_remove(url):
        removed.append(url)
        registry.remove(url)

    disc = RayDiscovery(RouterConfig(), registry, on_remove, lister=lambda: list(actors),
                        url_of=url_of)
    added, gone = asyncio.run(disc.poll_once())
    assert sorted(added) == ["http://r0:1", "http://r1:1"] and gone == []
    # a static worker that Ray also lists (radixray serve passes both) is Ray's from now on
    assert {w.url: w.source for w in registry.all()} == {
        "http://static:1": "ray", "http://r0:1": "ray", "http://r1:1": "ray"}
    assert disc.apply(disc.discover()) == ([], [])  # steady state
    actors.pop(1)  # replica:1 died
    urls["replica:0"] = "http://r0:2"  # replica:0 restarted elsewhere
    urls["replica:static"] = "http://static:2"  # ... and so did the one listed at start-up
    added, gone = disc.apply(disc.discover())
    assert sorted(added) == ["http://r0:2", "http://static:2"]
    assert sorted(gone) == ["http://r0:1", "http://r1:1", "http://static:1"]
    assert sorted(w.url for w in registry.all()) == ["http://r0:2", "http://static:2"]
    actors.pop()  # replica:static left
    assert disc.apply(disc.discover()) == ([], ["http://static:2"])
    registry.add("http://manual:1")  # never listed by Ray: discovery leaves it alone
    broken.add("replica:0")  # listed but not answering: kept, no flapping
    assert disc.apply(disc.discover()) == ([], [])
    actors.clear()
    assert disc.apply(disc.discover()) == ([], ["http://r0:2"])
    assert [w.url for w in registry.all()] == ["http://manual:1"]
    broken.clear()  # a replica first seen while not answering is added once it answers
    actors.append({"name": "replica:9", "namespace": "radixray"})
    urls["replica:9"] = "http://r9:1"
    broken.add("replica:9")
    assert disc.apply(disc.discover()) == ([], [])
    broken.clear()
    assert disc.apply(disc.discover()) == (["http://r9:1"], [])


def test_sweep_drops_gone_and_unhealthy_workers_and_reasserts_bounds():
    from radixray.router.app import Router

    router = Router(RouterConfig(worker_urls=["http://a:1", "http://b:1", "http://c:1"],
                                 max_tree_size=1000))
    for url in ("http://a:1", "http://b:1", "http://c:1", "http://ghost:1"):
        router.tree.insert(url * 20, url)
    router.registry.get("http://b:1").healthy = False  # flag flipped without a notice
    router.registry.get("http://c:1").tree_limit = 100  # capacity learned after the inserts
    router.sweep()
    assert sorted(router.tree.tenants()) == ["http://a:1", "http://c:1"]
    assert router.tree.size("http://a:1") == 200
    # the 193-char leaf went; the "http://" node shared with a stays
    assert router.tree.size("http://c:1") == len("http://")


def test_only_a_newer_cache_epoch_drops_a_workers_tree():
    """A slow answer carrying an older epoch (overtaken by a newer one) must not drop the tree
    again: epochs are ``<engine>.<flushes>``, newer meaning a new engine or more flushes."""
    from radixray.router.config import RouterConfig
    from radixray.router.workers import WorkerRegistry

    registry = WorkerRegistry(RouterConfig())
    dropped = []
    registry.on_down(dropped.append)
    worker = registry.add("http://w:1")
    seen = [registry.observe_epoch(worker, e) for e in (
        "a.0",  # the first sighting: nothing to drop
        "a.0", "a.1",  # a flush
        "a.0",  # stale
        "b.0",  # a restart
        "a.1", "a.2",  # stale: a retired engine
        "b.1", None, "")]
    assert seen == [False, False, True, False, True, False, False, True, False, False]
    assert dropped == ["http://w:1"] * 3 and worker.cache_epoch == "b.1"
