"""A replica's engine slot across restarts: /metrics counters go on from the replaced engines'
final totals (requests the dead engine failed included), and while no engine serves the gauges
say that nothing runs. Before, a restart froze the gauges at the dead engine's last values
("4 running, 134 tok/s" on a replica that was down), lost the failed requests, and a new
engine that passed the old total before the next scrape was undercounted."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from http_helpers import make_engine
from radixray.cluster.engine_protocol import GenerateRequest
from radixray.cluster.engine_slot import SwappableEngine
from radixray.cluster.metrics import EngineMetrics
from radixray.scheduler.request import Req
from radixray.worker.sampling_params import SamplingParams


class StubEngine:
    def __init__(self, stats: dict):
        self.snapshot, self.alive, self.stopped = stats, True, False

    def stats(self) -> dict:
        return dict(self.snapshot)

    def server_info(self) -> dict:
        return {}


def scrape(metrics: EngineMetrics, slot: SwappableEngine) -> dict:
    metrics.update_scheduler_stats(slot.stats())
    return {name: c._value.get() for name, c in metrics.counters.items()} | {
        name: g._value.get() for name, g in metrics.gauges.items()}


def test_counters_go_on_across_engines_and_gauges_idle_while_restarting():
    slot = SwappableEngine()
    metrics = EngineMetrics(CollectorRegistry(), "m", 0)
    first = StubEngine({"num_requests_total": 100, "num_running_reqs": 4,
                        "gen_throughput": 134.0})
    slot.swap(first)
    assert scrape(metrics, slot)["num_requests_total"] == 100
    first.snapshot.update(num_requests_total=103)  # 3 more finished, then the ranks died
    first.alive = False  # its thread still runs: a shutdown that timed out inside a step
    seen = scrape(metrics, slot)
    assert seen["num_running_reqs"] == 0 and seen["gen_throughput"] == 0  # not 4, not 134
    assert seen["num_requests_total"] == 103
    slot.swap(None)
    assert scrape(metrics, slot)["num_requests_total"] == 103
    first.snapshot.update(num_requests_total=107)  # it failed 4 more as its thread ended
    first.stopped = True
    assert scrape(metrics, slot)["num_requests_total"] == 107
    first.snapshot.update(num_requests_total=0)  # folded for good: its later words no matter
    second = StubEngine({"num_requests_total": 150, "num_running_reqs": 2})
    slot.swap(second)  # 150 requests before the next scrape: more than the old engine's 103
    seen = scrape(metrics, slot)
    assert seen["num_requests_total"] == 257 and seen["num_running_reqs"] == 2


def test_the_cache_hit_rate_covers_every_engine_the_replica_ran():
    """It restarted from 0 with each new engine, while its help says "since the replica
    started" and the token counters it is the ratio of go on."""
    slot = SwappableEngine()
    first = StubEngine({"prompt_tokens_total": 100, "cached_tokens_total": 40,
                        "cache_hit_rate": 0.4})
    slot.swap(first)
    assert slot.stats()["cache_hit_rate"] == 0.4
    first.alive = False
    slot.swap(None)
    first.stopped = True
    assert slot.stats()["cache_hit_rate"] == 0.4  # while restarting too
    slot.swap(StubEngine({"prompt_tokens_total": 100, "cached_tokens_total": 0,
                          "cache_hit_rate": 0.0}))
    assert slot.stats()["cache_hit_rate"] == 0.2
    assert SwappableEngine().stats()["cache_hit_rate"] == 0.0


def test_requests_an_engine_fails_when_it_stops_are_counted_with_their_prompts(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    before = engine.stats()

    async def start_and_stop() -> dict:
        req = GenerateRequest("long", [5, 6, 7], SamplingParams(max_new_tokens=1500,
                                                                 ignore_eos=True))
        probe = GenerateRequest("health", [5], SamplingParams(max_new_tokens=1500,
                                                              ignore_eos=True), probe=True)
        stream, checking = engine.generate(req), engine.generate(probe)
        await stream.__anext__()  # it runs
        await checking.__anext__()  # and so does a health probe: failed, it counts nowhere
        await asyncio.to_thread(engine.shutdown)
        assert [out async for out in checking][-1].finish_reason["status_code"] == 503
        return [out async for out in stream][-1].finish_reason

    assert asyncio.run(start_and_stop())["status_code"] == 503
    after = engine.stats()
    for key in ("num_requests_total", "num_aborted_requests_total"):
        assert after[key] == before.get(key, 0) + 1, key
    assert after["prompt_tokens_total"] == before.get("prompt_tokens_total", 0) + 3


def test_commands_after_the_engine_stopped_fail_at_once(tiny_llama_path):
    """They went into an inbox no thread read any more: flush_cache (which /flush_cache turns
    into a 503) and a generate that raced the stop waited for ever."""
    engine = make_engine(tiny_llama_path)
    engine.shutdown()

    async def after_stop():
        with pytest.raises(RuntimeError, match="engine stopped"):
            await asyncio.wait_for(engine.flush_cache(), 5)
        queue = asyncio.Queue()  # a generate past its alive check when the thread stopped
        engine._send(("add", Req("late", [5, 6], SamplingParams(max_new_tokens=2)),
                      asyncio.get_running_loop(), queue))
        return await asyncio.wait_for(queue.get(), 5)

    assert "engine stopped" in str(asyncio.run(after_stop()))
    with pytest.raises(RuntimeError, match="engine stopped"):
        engine.call_sync(lambda s: None, timeout=5)


def test_a_call_its_caller_gave_up_on_leaves_the_engine_running(tiny_llama_path):
    """A timed-out call's future is cancelled; the engine thread then set its result and died
    of the InvalidStateError (every request of the replica failed)."""
    import time

    engine = make_engine(tiny_llama_path)

    async def scenario():
        slow = asyncio.ensure_future(engine.call(lambda s: time.sleep(0.5)))
        await asyncio.sleep(0.1)  # the engine thread is in it
        with pytest.raises(asyncio.TimeoutError):
            await engine.call(lambda s: 1, timeout=0.05)  # queued behind the slow one
        await slow
        return await engine.call(lambda s: 2, timeout=10)

    assert asyncio.run(scenario()) == 2
    assert engine.alive and engine.failure is None
    engine.shutdown()


def test_server_info_while_restarting_is_the_last_engines():
    """It was {} for the seconds of a restart: a monitor reading `restarts` got nothing."""
    slot = SwappableEngine()
    engine = StubEngine({})
    engine.server_info = lambda: {"restarts": 2, "max_total_num_tokens": 2048}
    slot.swap(engine)
    engine.alive = False
    slot.swap(None)
    assert slot.server_info() == {"restarts": 2, "max_total_num_tokens": 2048}


def test_a_client_hears_an_engine_failure_in_a_few_words():
    from radixray.cluster.async_engine import client_reason

    ray_like = RuntimeError("The actor died unexpectedly before finishing this task.\n"
                            "\tclass_name: TPWorker\n\tactor_id: abc\n" + "advice " * 200)
    assert client_reason(ray_like) == ("RuntimeError: The actor died unexpectedly before "
                                       "finishing this task.")
    assert len(client_reason(ValueError("x" * 1000))) == 200
    gloo = RuntimeError("RayTaskError(RuntimeError): RuntimeError: [/__w/pytorch/pytorch/third_"
                        "party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1")
    assert client_reason(gloo) == ("RuntimeError: RayTaskError(RuntimeError): RuntimeError: "
                                   "Read error [127.0.0.1]:1")
