"""The scheduler end to end against FakeRunner: every output must equal the plain reference.

FakeRunner's tokens are a hash of the context read back through the KV slots, so any slot
bookkeeping mistake (a slot freed while still read, a row not carried after it changed, a
chunk written to the wrong place) changes the generated tokens. Every scheduler here runs
with ``debug_invariants`` (memory invariant after every step) and ``run`` checks it again at
the end, with nothing locked or leaked.
"""

from __future__ import annotations

import random

import pytest

from fake_runner import reference_tokens
from radixray.scheduler.config import SCHEDULE_POLICIES
from scheduler_harness import (assert_matches_reference, collect, make, req, run,
                               shared_prefix_workload, trie_size)

pytestmark = pytest.mark.usefixtures("runner_kind")


@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
def test_every_policy_matches_reference_on_shared_prefixes(policy):
    work = shared_prefix_workload()
    sched, _ = make(schedule_policy=policy)
    results = run(sched, [req(r, p, n) for r, p, n in work])
    assert_matches_reference(results, work)
    assert sum(res.last.cached_tokens for res in results.values()) > 0


@pytest.mark.parametrize("page", [1, 4])
def test_chunked_prefill_and_mixed_chunk(page):
    work = shared_prefix_workload(seed=1, sys_len=150, q_len=(30, 90))
    for mixed in (False, True):
        sched, runner = make(chunked_prefill_size=64, enable_mixed_chunk=mixed, page=page)
        runner.keep_batches = True
        results = run(sched, [req(r, p, n) for r, p, n in work])
        assert_matches_reference(results, work)
        prefill_pieces = [int(e) for b in runner.batches
                          for e, c in zip(b.extend_lens, b.prefix_slot_lens) if e > 1]
        assert max(prefill_pieces) <= 64  # long prompts were cut into chunks
        assert (sched.stats.num_mixed_batches > 0) == mixed


@pytest.mark.parametrize("page", [1, 4])
def test_retraction_in_a_tiny_pool_keeps_outputs_exact(page):
    rng = random.Random(3)
    work = [(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(10, 30))], 40)
            for i in range(8)]
    sched, _ = make(pool=200, page=page, chunked_prefill_size=32)
    results = run(sched, [req(r, p, n) for r, p, n in work])
    assert sched.stats.num_retracted > 0 and sched.cache.evicted_tokens > 0
    assert_matches_reference(results, work)
    assert sched.ratio.value > sched.ratio.min  # the ratio jumped after retracting


@pytest.mark.parametrize("page", [1, 4])
def test_a_request_that_outgrows_the_pool_alone_ends_by_length_with_its_answer(page):
    """It was aborted ("out of KV memory") when the pool filled: /generate answered 200 with an
    abort, a streamed completion an in-band 400, each after the tokens were computed. The
    pool is a length limit like the context: the answer ends there, with ``length``."""
    prompt = list(range(40))
    sched, _ = make(pool=64, page=page)
    results = run(sched, [req("big", prompt, 100, ignore_eos=True)])
    out = results["big"]
    assert out.last.finish_reason.to_dict() == {"type": "length", "length": 64 - 40}
    assert out.tokens == reference_tokens(prompt, 100)[:24]


@pytest.mark.parametrize("page", [1, 4])
def test_cache_hit_contract(page):
    sched, _ = make(pool=24000, page=page, chunked_prefill_size=4096, debug_invariants=False)

    def cached(ids):
        return run(sched, [req(f"c{len(ids)}-{random.random()}", ids, 1)]).popitem()[1] \
            .last.cached_tokens

    def floor(n):
        return n - n % page

    assert cached(list(range(100))) == 0
    assert cached(list(range(10000))) == 100
    assert cached(list(range(10000))) == floor(9999)
    assert cached(list(range(1000))) == floor(999)
    assert cached(list(range(11000))) == 10000


def test_in_batch_sharing_computes_a_shared_prefix_once():
    rng = random.Random(5)
    system = [rng.randrange(1000) for _ in range(512)]
    work = [(f"q{i}", system + [rng.randrange(1000) for _ in range(16)], 4) for i in range(50)]
    sched, _ = make()
    results = run(sched, [req(r, p, n) for r, p, n in work])
    assert_matches_reference(results, work)
    # The prefix once plus each question; a question that happens to start like an earlier
    # one may hit a token or two of it (the least possible is the prompts' trie size).
    minimum = trie_size([p for _, p, _ in work])
    assert minimum <= sched.stats.prefill_tokens <= 512 + 50 * 16
    # Also while the first request's prompt is computed in chunks.
    sched, _ = make(chunked_prefill_size=200)
    assert_matches_reference(run(sched, [req(r, p, n) for r, p, n in work]), work)
    assert minimum <= sched.stats.prefill_tokens <= 512 + 50 * 16
    # Without the prefix cache every request computes its whole prompt.
    sched, _ = make(disable_radix_cache=True)
    run(sched, [req(r, p, n) for r, p, n in work])
    assert sched.stats.prefill_tokens == 50 * 528


def test_rows_rewritten_by_a_concurrent_insert_are_carried_again():
    """Two requests compute the same tokens in one batch; the second's copies are freed and
    its row re-pointed at the tree. Its decode steps must carry the new row, or it reads
    slots that other requests have since overwritten."""
    rng = random.Random(9)
    base = [rng.randrange(1000) for _ in range(64)]
    tail = [rng.randrange(1000) for _ in range(20)]  # < 32 more shared: both are admitted
    sched, runner = make(pool=400)
    runner.keep_batches = True
    run(sched, [req("warm", base + [1], 1)])  # caches `base`: both twins hit 64 > 32 tokens
    twins = [req("a", base + tail, 30), req("b", base + tail, 30)]
    others = [req(f"o{i}", [rng.randrange(1000) for _ in range(20)], 20) for i in range(6)]
    results = run(sched, twins + others)
    for r in twins + others:
        assert results[r.rid].tokens == reference_tokens(r.origin_input_ids, r.sampling_params.max_new_tokens)
    assert any(int(b.prefix_slot_lens.sum()) > 0 and bool((b.extend_lens == 1).all())
               for b in runner.batches), "no decode step carried a re-pointed row"


def test_abort_waiting_and_running_requests():
    sched, _ = make(max_prefill_tokens=1)  # one prefill per round: some requests wait
    reqs = [req(f"r{i}", list(range(i * 50, i * 50 + 30)), 50) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    results = collect({}, sched.step())  # r0 prefilled
    collect(results, sched.step())  # r1 prefilled
    assert sched.abort("r0") and sched.abort("r3")
    assert not sched.abort("nope")
    run(sched, results=results)
    for rid in ("r0", "r3"):
        assert results[rid].last.finish_reason.to_dict() == {"type": "abort",
                                                             "message": "aborted by request"}
    assert len(results["r0"].tokens) < 50 and results["r3"].tokens == []
    for r in reqs[1:3]:
        assert results[r.rid].tokens == reference_tokens(r.origin_input_ids, 50)
    assert sched.stats.num_aborted == 2


def test_abort_a_prompt_mid_chunk():
    sched, _ = make(chunked_prefill_size=32)
    results = run(sched, [req("short", list(range(10)), 3)])
    sched.add_request(req("long", list(range(500, 700)), 5))
    collect(results, sched.step())
    assert sched.chunked_req is not None and sched.chunked_req.rid == "long"
    assert sched.abort("long", "client went away")
    run(sched, [req("after", list(range(500, 560)), 3)], results=results)
    assert results["long"].tokens == []
    assert results["long"].last.finish_reason.to_dict() == {"type": "abort",
                                                           "message": "client went away"}
    assert results["after"].tokens == reference_tokens(list(range(500, 560)), 3)
    assert results["after"].last.cached_tokens == 32  # the chunk it computed stayed cached


@pytest.mark.parametrize("page", [1, 4])
def test_disabled_cache_keeps_nothing(page):
    work = shared_prefix_workload(seed=4)
    sched, _ = make(page=page, disable_radix_cache=True, chunked_prefill_size=48)
    results = run(sched, [req(r, p, n) for r, p, n in work])
    assert_matches_reference(results, work)
    assert all(res.last.cached_tokens == 0 for res in results.values())
    assert sched.cache.tree.total_size() == 0


def test_overlap_keeps_two_batches_in_flight_and_wastes_at_most_one_step(runner_kind):
    sched, runner = make()
    prompts = [list(range(k * 50, k * 50 + 20)) for k in range(3)]
    results = run(sched, [req(f"r{k}", p, 30) for k, p in enumerate(prompts)])
    for k, p in enumerate(prompts):
        assert results[f"r{k}"].tokens == reference_tokens(p, 30)
    if runner_kind == "overlap":
        assert runner.max_in_flight == 2 and runner.in_flight == 0
        # one prefill, 29 decodes, and one wasted decode after the last token was sampled
        assert runner.num_forward == 31
    else:
        assert runner.num_forward == 30


def test_overlap_continues_while_requests_wait(runner_kind):
    """A full running set with a queue behind it (the loaded-server case) still overlaps:
    decodes and the prefills that admit waiting requests are submitted while a batch runs."""
    sched, runner = make(running=4)
    overlapped = {"decode": 0, "prefill": 0}
    if runner_kind == "overlap":
        submit = runner.submit

        def watching_submit(batch):
            handle = submit(batch)
            if runner.in_flight == 2:  # submitted before the previous batch's results came
                overlapped["prefill" if int(batch.extend_lens.max()) > 1 else "decode"] += 1
            return handle
        runner.submit = watching_submit
    prompts = [list(range(k * 40, k * 40 + 24)) for k in range(12)]
    results = run(sched, [req(f"r{k}", p, 12) for k, p in enumerate(prompts)])
    for k, p in enumerate(prompts):
        assert results[f"r{k}"].tokens == reference_tokens(p, 12)
    if runner_kind == "overlap":
        assert overlapped["decode"] > 0 and overlapped["prefill"] > 0, overlapped
