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
import torch

from fake_runner import (FakeRunner, OverlapFakeRunner, reference_input_logprobs,
                         reference_tokens)
from radixray.scheduler.config import SCHEDULE_POLICIES, SchedulerConfig
from radixray.scheduler.radix_cache import RadixCache, RadixKey
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.scheduler.stop import trim_stop_text
from radixray.worker.sampling_params import SamplingParams


@pytest.fixture(autouse=True, params=["sync", "overlap"])
def runner_kind(request):
    """Every scheduler test runs twice: one batch at a time, and with overlap scheduling
    (batch N+1 built and submitted before batch N's tokens are processed)."""
    global RUNNER
    RUNNER = FakeRunner if request.param == "sync" else OverlapFakeRunner
    yield request.param


def make(pool=8192, running=64, context=16384, page=1, eos=(), decode=None, **cfg):
    cfg.setdefault("debug_invariants", True)
    runner = RUNNER(pool, running, context, page)
    sched = Scheduler(SchedulerConfig(page_size=page, **cfg), runner, eos_token_ids=eos,
                      decode=decode)
    return sched, runner


def req(rid, prompt, max_new=8, **kw):
    params = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__dataclass_fields__}
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new, **params), **kw)


class Result:
    def __init__(self):
        self.tokens, self.outputs = [], []

    @property
    def last(self):
        return self.outputs[-1]


def collect(results: dict[str, Result], outputs) -> dict[str, Result]:
    for out in outputs:
        res = results.setdefault(out.rid, Result())
        res.tokens += out.new_token_ids
        res.outputs.append(out)
    return results


def run(sched, reqs=(), max_steps=20000, results=None) -> dict[str, Result]:
    """Queue ``reqs``, step until nothing is live, check the ledgers are clean at the end."""
    for r in reqs:
        sched.add_request(r)
    results = {} if results is None else results
    for _ in range(max_steps):
        if not sched.has_work:
            break
        collect(results, sched.step())
    assert not sched.has_work, "scheduler did not finish"
    assert_clean(sched)
    return results


def assert_clean(sched):
    sched.check_invariant()
    cache = sched.cache
    assert cache.tree.protected_size() == 0
    assert cache.available_size() + cache.tree.total_size() == cache.pool_size
    assert cache.free_rows() == cache.rows.size


def trie_size(prompts) -> int:
    trie = RadixCache()
    for p in prompts:
        trie.insert(RadixKey(p), torch.zeros(len(p), dtype=torch.int64))
    return trie.total_size()


def shared_prefix_workload(seed=0, groups=4, per_group=6, sys_len=80, q_len=(5, 40)):
    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        system = [rng.randrange(1000) for _ in range(sys_len)]
        for j in range(per_group):
            q = [rng.randrange(1000) for _ in range(rng.randint(*q_len))]
            reqs.append((f"g{g}-{j}", system + q, rng.randint(1, 24)))
    rng.shuffle(reqs)
    return reqs


def assert_matches_reference(results, workload):
    for rid, prompt, max_new in workload:
        assert results[rid].tokens == reference_tokens(prompt, max_new), rid
        assert results[rid].last.finish_reason.to_dict() == {"type": "length", "length": max_new}
        assert results[rid].last.completion_tokens == max_new


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


def test_request_that_cannot_fit_alone_is_aborted_with_a_clear_reason():
    prompt = list(range(40))
    sched, _ = make(pool=64)
    results = run(sched, [req("big", prompt, 100)])
    out = results["big"]
    reason = out.last.finish_reason.to_dict()
    assert reason["type"] == "abort" and "out of KV memory" in reason["message"]
    assert out.tokens == reference_tokens(prompt, 100)[: len(out.tokens)]
    assert 20 <= len(out.tokens) < 100


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


PIECES = ["ab", "c", "de", "f", "gh", "i", "jk", "l"]


def piece_decode(ids):
    return "".join(PIECES[t % len(PIECES)] for t in ids)


def test_stop_strings_match_across_token_boundaries_and_are_trimmed():
    prompt = list(range(20))
    full = reference_tokens(prompt, 30)
    text = piece_decode(full)
    # A stop string that starts inside token k's text and ends inside token k+1's, and
    # appears nowhere before.
    for k in range(2, 28):
        start = len(piece_decode(full[: k + 1])) - 1
        stop = text[start : start + 2]
        if len(PIECES[full[k] % 8]) == 2 and text.find(stop) == start:
            break
    else:
        pytest.fail("no token boundary to test in this sequence")
    sched, _ = make(decode=piece_decode)
    results = run(sched, [req("s", prompt, 30, stop=["zz", stop])])
    out = results["s"]
    assert out.tokens == full[: k + 2]
    assert out.last.finish_reason.to_dict() == {"type": "stop", "matched": stop}
    out_text = piece_decode(out.tokens)
    assert trim_stop_text(out_text, out.last.finish_reason, False) == text[:start]
    assert trim_stop_text(out_text, out.last.finish_reason, True) == out_text  # no_stop_trim


def test_eos_stop_token_ids_ignore_eos_and_min_new_tokens():
    prompt = list(range(10, 40))
    full = reference_tokens(prompt, 20)
    eos = full[4]
    first = full.index(eos)
    sched, _ = make(eos=[eos])
    results = run(sched, [req("eos", prompt, 20), req("ign", prompt, 20, ignore_eos=True),
                          req("ids", prompt, 20, ignore_eos=True, stop_token_ids=[full[7]]),
                          req("min", prompt, 20, min_new_tokens=first + 2)])
    assert results["eos"].tokens == full[: first + 1]
    assert results["eos"].last.finish_reason.to_dict() == {"type": "stop", "matched": eos}
    assert results["ign"].tokens == full
    assert results["ids"].tokens == full[: full.index(full[7]) + 1]
    later = [k for k in range(first + 1, 20) if full[k] == eos]
    assert results["min"].tokens == (full[: later[0] + 1] if later else full)


def assert_logprobs_equal(got, want, unknown=()):
    """Entries (logprob or None, token id); positions in ``unknown`` must be None."""
    assert len(got) == len(want)
    for k, ((g, g_id), (w, w_id)) in enumerate(zip(got, want)):
        assert g_id == w_id, k
        if w is None or k in unknown:
            assert g is None, k
        else:
            assert g == pytest.approx(w, abs=1e-5), k


def test_max_new_tokens_zero_fills_the_cache_and_returns_input_logprobs():
    prompt = list(range(200, 260))
    sched, _ = make()
    results = run(sched, [req("fill", prompt, 0, return_logprob=True, logprob_start_len=20)])
    out = results["fill"].last
    assert out.new_token_ids == [] and out.completion_tokens == 0
    assert out.finish_reason.to_dict() == {"type": "length", "length": 0}
    assert_logprobs_equal(out.input_token_logprobs, reference_input_logprobs(prompt, 20))
    again = run(sched, [req("again", prompt, 2)])["again"]
    assert again.last.cached_tokens == len(prompt) - 1


def test_input_logprobs_limit_the_cache_match_and_cross_chunks():
    prompt = list(range(300, 500))
    sched, _ = make(chunked_prefill_size=64)
    run(sched, [req("warm", prompt, 1)])  # the whole prompt is cached now
    results = run(sched, [req("lp", prompt, 3, return_logprob=True, logprob_start_len=50,
                              top_logprobs_num=2)])
    out = results["lp"]
    assert out.outputs[0].cached_tokens == 50  # the match stopped where logprobs start
    got = out.outputs[0].input_token_logprobs
    assert len(got) == len(prompt) - 50 and got[0][0] is None
    seams = {k - 50 for k in range(50 + 64, len(prompt), 64)}  # first token of later chunks
    assert_logprobs_equal(got, reference_input_logprobs(prompt, 50), unknown=seams)
    assert [len(o.output_token_logprobs) for o in out.outputs] == [1, 1, 1]
    assert all(len(o.output_top_logprobs[0]) == 2 for o in out.outputs)


def _first_token_order(sched, reqs):
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.has_work:
        order += [o.rid for o in sched.step() if o.completion_tokens == 1 and o.new_token_ids]
    assert_clean(sched)
    return order


def test_lpm_admits_the_longest_cached_prefix_first():
    rng = random.Random(11)
    hot = [rng.randrange(1000) for _ in range(200)]
    sched, _ = make(schedule_policy="lpm", max_prefill_tokens=1)
    run(sched, [req("warm", hot + [1, 2], 1)])
    cold = [rng.randrange(1000) for _ in range(60)]
    reqs = [req("none", cold, 2), req("some", hot[:80] + cold, 2), req("all", hot + cold, 2)]
    assert _first_token_order(sched, reqs) == ["all", "some", "none"]
    sched, _ = make(schedule_policy="fcfs", max_prefill_tokens=1)
    assert _first_token_order(sched, [req(r.rid, r.origin_input_ids, 2) for r in reqs]) == \
        ["none", "some", "all"]


def test_priority_lof_and_routing_key_orders():
    prompts = [list(range(k * 100, k * 100 + 40)) for k in range(4)]
    sched, _ = make(schedule_policy="priority", max_prefill_tokens=1)
    reqs = [req(f"p{p}", prompts[i], 2, priority=p) for i, p in enumerate([0, 5, None, 1])]
    assert _first_token_order(sched, reqs) == ["p5", "p1", "p0", "pNone"]

    sched, _ = make(schedule_policy="lof", max_prefill_tokens=1)
    reqs = [req(f"n{n}", prompts[i], n) for i, n in enumerate([2, 9, 4])]
    assert _first_token_order(sched, reqs) == ["n9", "n4", "n2"]

    sched, _ = make(schedule_policy="routing-key", max_prefill_tokens=1)
    sched.add_request(req("runner", prompts[3], 50, routing_key="a"))
    sched.step()  # "runner" is running with key "a" (its first token may come a step later)
    reqs = [req("b", prompts[0], 2, routing_key="b"), req("none", prompts[1], 2),
            req("a", prompts[2], 2, routing_key="a")]
    assert [r for r in _first_token_order(sched, reqs) if r != "runner"] == ["a", "b", "none"]


def test_extra_key_keeps_salted_requests_apart():
    prompt = list(range(700, 800))
    sched, _ = make()
    run(sched, [req("x", prompt, 1, extra_key="salt-1")])
    other = run(sched, [req("y", prompt, 1, extra_key="salt-2")])["y"].last.cached_tokens
    same = run(sched, [req("z", prompt, 1, extra_key="salt-1")])["z"].last.cached_tokens
    assert (other, same) == (0, 99)


def test_flush_cache_only_when_idle():
    sched, _ = make()
    sched.add_request(req("r", list(range(50)), 3))
    assert not sched.flush_cache()
    run(sched)
    assert sched.cache.tree.total_size() > 0
    assert sched.flush_cache()
    assert sched.cache.tree.total_size() == 0
    assert sched.cache.available_size() == sched.cache.pool_size


def test_add_request_rejects_what_can_never_run():
    sched, _ = make(pool=100, context=80)
    with pytest.raises(ValueError, match="^input_ids: .*context length is 80"):
        sched.add_request(req("long", list(range(80))))
    sched, _ = make(pool=50, context=80)
    with pytest.raises(ValueError, match="^input_ids: .*KV pool holds 50"):
        sched.add_request(req("big", list(range(60))))
    sched.add_request(req("dup", [1, 2, 3]))
    with pytest.raises(ValueError, match="^rid: "):
        sched.add_request(req("dup", [1, 2, 3]))
    with pytest.raises(ValueError, match="^max_new_tokens: "):
        sched.add_request(req("neg", [1], -1))
    with pytest.raises(ValueError, match="^stop: "):
        sched.add_request(req("stop", [1], 2, stop=["x"]))  # no decode function given
    run(sched)


def test_metrics_snapshot_names_and_values():
    sched, _ = make()
    run(sched, [req("a", list(range(64)), 4), req("b", list(range(64)), 4)])
    m = sched.metrics()
    assert m["num_requests_total"] == 2 and m["generation_tokens_total"] == 8
    assert m["prompt_tokens_total"] == 128 and m["num_running_reqs"] == 0
    assert 0 < m["cached_tokens_total"] < 128 and 0 <= m["token_usage"] <= 1
    assert m["kv_available_tokens"] + m["kv_evictable_tokens"] == sched.cache.pool_size


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
