"""A prompt mid-chunk when decode runs out of KV slots: the chunked request is retracted (its
computed chunks stay in the tree, unlocked) before any running request, and a request that
fits the pool alone is never aborted. Against FakeRunner, with and without overlap
scheduling; every run ends with the memory invariant (``run``)."""

from __future__ import annotations

import random

import pytest

from fake_runner import reference_input_logprobs, reference_tokens
from radixray.scheduler.decode import make_room_for_decode
from radixray.scheduler.token_ratio import CLIP_MAX_NEW_TOKENS
from scheduler_harness import collect, make, req, run

pytestmark = pytest.mark.usefixtures("runner_kind")


def _admission_budget(sched) -> int:
    """What the prefill adder would offer a request now (free + evictable slots minus the
    running requests' reservations)."""
    reserved = sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * sched.ratio.value
                   for r in sched.running)
    return int(sched.cache.available_and_evictable() - reserved)


@pytest.mark.parametrize("chunk", [8, 16])
def test_decoding_request_survives_a_chunked_prompt_that_fills_the_pool(chunk):
    """The probe's case (pool 300, mixed chunk): B (20 + 200 tokens) decodes; A, sized just
    under the admission budget, is prefilled in chunks while B's decodes ride along and eat
    the room A was admitted with. A's prefill stalls holding its chunks; B then decodes alone
    until the pool is full. Before the fix B was aborted for "out of KV memory" although it
    fits the pool alone; now A is retracted and B finishes, then A, both exact."""
    rng = random.Random(0)
    retracted_runs = 0
    for k in range(6):
        sched, _ = make(pool=300, chunked_prefill_size=chunk, enable_mixed_chunk=True)
        b = req("B", [rng.randrange(1000) for _ in range(20)], 200, ignore_eos=True)
        sched.add_request(b)
        results = {}
        for _ in range(10):
            collect(results, sched.step())
        a_prompt = [rng.randrange(1000) for _ in range(_admission_budget(sched) - 2 - k)]
        a = req("A", a_prompt, 1, return_logprob=True, logprob_start_len=0)
        results = run(sched, [a], results=results)
        assert results["B"].last.finish_reason.to_dict() == {"type": "length", "length": 200}
        assert results["B"].tokens == reference_tokens(b.origin_input_ids, 200)
        assert results["A"].tokens == reference_tokens(a_prompt, 1)
        # A's input logprobs start over when it comes back: complete, no duplicates
        got = results["A"].outputs[-1].input_token_logprobs
        want = reference_input_logprobs(a_prompt, 0)
        assert [t for _, t in got] == [t for _, t in want] and got[0][0] is None
        assert [v for v, _ in got[1:]] == pytest.approx([v for v, _ in want[1:]], abs=1e-5)
        assert sched.chunked_req is None and sched.stats.num_aborted == 0
        assert b.num_retractions == 0  # releasing the stalled chunk was enough
        retracted_runs += a.num_retractions > 0
    assert retracted_runs > 0  # the workload did reach the retraction


@pytest.mark.parametrize("mixed", [False, True])
def test_stalled_chunk_is_retracted_before_the_last_running_request_is_aborted(mixed):
    """Without mixed chunk the same hole: a chunked prompt that gets no piece (here the
    over-commit ratio jumps, as after a retraction) while the running requests grow. The
    chunked request goes back to the queue first; its computed chunks are reused when it
    returns unless decode needed their slots."""
    rng = random.Random(1)
    sched, _ = make(pool=200, chunked_prefill_size=16, enable_mixed_chunk=mixed)
    b_prompt = [rng.randrange(1000) for _ in range(10)]
    results = collect({}, [])
    b = req("B", b_prompt, 150, ignore_eos=True)
    sched.add_request(b)
    collect(results, sched.step())
    a_prompt = [rng.randrange(1000) for _ in range(100)]
    sched.ratio.value = sched.ratio.min  # admit A generously ...
    a = req("A", a_prompt, 4)
    sched.add_request(a)
    while sched.chunked_req is None:
        collect(results, sched.step())
    sched.ratio.value = 1.0  # ... then B's full remaining output is reserved: A stalls
    results = run(sched, results=results)
    assert results["B"].last.finish_reason.to_dict() == {"type": "length", "length": 150}
    assert results["B"].tokens == reference_tokens(b_prompt, 150)
    assert results["A"].tokens == reference_tokens(a_prompt, 4)
    assert a.num_retractions >= 1 and b.num_retractions == 0 and sched.stats.num_aborted == 0


def test_make_room_retracts_the_stalled_chunk_first():
    """Unit level: one running request short of a slot, a chunked request holding chunks.
    The chunk is released (its tree prefix unlocked and evictable), the running one stays."""
    sched, _ = make(pool=100, chunked_prefill_size=16, debug_invariants=False)
    results = collect({}, [])
    sched.add_request(req("run", list(range(100, 110)), 60, ignore_eos=True))
    collect(results, sched.step())
    sched.add_request(req("chunk", list(range(300, 340)), 2))
    while sched.chunked_req is None or sched.chunked_req.cached_len < 32:
        collect(results, sched.step())
    if sched.in_flight:
        sched.loop.finish()
    chunked, running = sched.chunked_req, list(sched.running)
    cache = sched.cache
    # take every free slot: the running request cannot decode without the chunk's slots
    assert cache.evictable_size() == 0  # all cached tokens are locked by the two requests
    cache.allocator.alloc(cache.allocator.available_size())
    room = make_room_for_decode(running, cache, chunked)
    assert room.retracted == [chunked] and room.aborted == [] and running == sched.running
    assert chunked.req_pool_idx is None and chunked.num_retractions == 1
    assert cache.evictable_size() >= 32  # its chunks stay cached, now evictable


def test_a_request_alone_that_outgrows_the_pool_is_aborted_with_a_true_reason():
    """``add_request`` cuts max_new_tokens to what the pool holds; one that outgrows it anyway
    (here its limit raised behind the scheduler's back) is aborted, saying why."""
    from dataclasses import replace

    sched, _ = make(pool=64, chunked_prefill_size=16)
    big = req("big", list(range(40)), 100, ignore_eos=True)
    sched.add_request(big)
    big.sampling_params = replace(big.sampling_params, max_new_tokens=100)
    results = run(sched)
    reason = results["big"].last.finish_reason.to_dict()
    assert reason["type"] == "abort"
    assert reason["message"].startswith("out of KV memory: this request's next decode step "
                                        "needs 65 KV slots (65 tokens so far) and the whole "
                                        "pool holds 64")
    assert results["big"].tokens == reference_tokens(list(range(40)), 100)[:25]
