"""The scheduler's outputs beyond the tokens, against FakeRunner: stop strings, EOS and stop
ids, input logprobs, admission order per policy, cache salting, flushing, what is refused at
the door, and the metrics snapshot. Every test runs with and without overlap scheduling
(``runner_kind``) and ends with the ledgers checked (``run``)."""

from __future__ import annotations

import random

import pytest

from fake_runner import reference_input_logprobs, reference_tokens
from radixray.scheduler.stop import trim_stop_text
from scheduler_harness import assert_clean, collect, make, req, run

pytestmark = pytest.mark.usefixtures("runner_kind")


PIECES = ["ab", "c", "de", "f", "gh", "i", "jk", "l"]


def piece_decode(ids, **_):
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


def assert_logprobs_equal(got, want):
    """Entries (logprob or None, token id): None exactly where ``want`` has None."""
    assert len(got) == len(want)
    for k, ((g, g_id), (w, w_id)) in enumerate(zip(got, want)):
        assert g_id == w_id, k
        if w is None:
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
    # only the first entry is null: the chunk seams (50 + 64, 50 + 128) have their values
    assert_logprobs_equal(got, reference_input_logprobs(prompt, 50))
    assert [len(o.output_token_logprobs) for o in out.outputs] == [1, 1, 1]
    assert all(len(o.output_top_logprobs[0]) == 2 for o in out.outputs)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("page", [1, 4])
def test_input_logprobs_have_no_null_at_chunk_seams(mixed, page):
    """Every logprob start against every chunk boundary: a start on a boundary, just before
    one, in the last chunk (SGLang's select() sends len - 2 with max_new_tokens 0), with a
    request decoding beside the chunks (mixed chunk)."""
    rng = random.Random(4)
    prompt = [rng.randrange(1000) for _ in range(65)]
    for start in (0, 1, 15, 16, 31, 32, 47, 63, 64):
        sched, _ = make(chunked_prefill_size=16, enable_mixed_chunk=mixed, page=page)
        busy = req("busy", [rng.randrange(1000) for _ in range(5)], 30)
        lp = req("lp", prompt, 0 if start == 63 else 2, return_logprob=True,
                 logprob_start_len=start)
        sched.add_request(busy)
        results = {}
        for _ in range(2):  # busy decodes: a mixed batch carries it beside lp's chunks
            collect(results, sched.step())
        results = run(sched, [lp], results=results)
        got = next(o.input_token_logprobs for o in results["lp"].outputs
                   if o.input_token_logprobs is not None)
        assert_logprobs_equal(got, reference_input_logprobs(prompt, start))
        assert results["busy"].tokens == reference_tokens(busy.origin_input_ids, 30)
        assert sched.stats.num_mixed_batches > 0 or not mixed


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


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_full_batch_matches_no_waiting_prompt_and_a_key_is_packed_once(policy, monkeypatch):
    """lpm and dfs-weight matched (and packed the keys of) up to 128 waiting prompts every
    decode step even with every request row taken: 14 ms a step with 8k-token prompts."""
    from radixray.scheduler import request as request_module

    packed = []
    real_key = request_module.RadixKey
    monkeypatch.setattr(request_module, "RadixKey",
                        lambda ids, extra=None: packed.append(len(ids)) or real_key(ids, extra))
    sched, _ = make(running=2, schedule_policy=policy)
    reqs = [req(f"r{i}", [i + 1] * 300, 30) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    matches = []
    real_match = sched.cache.match
    monkeypatch.setattr(sched.cache, "match", lambda r: matches.append(r.rid) or real_match(r))
    sched.step()  # two admitted, four wait
    matches.clear()
    for _ in range(10):  # decode steps with both rows taken
        sched.step()
    assert matches == []
    results = run(sched)
    assert all(len(results[r.rid].tokens) == 30 for r in reqs[2:])
    assert packed.count(299) == 6  # each prompt's key once, however many rounds it waited


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
    with pytest.raises(ValueError, match="^input_ids: .*KV cache holds 50"):
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


def test_an_abort_while_the_prefill_is_in_flight_finishes_once():
    """Under overlap the aborted request's prefill is merged into running before its token
    comes back; it must get one finished output and count once (it used to get a second,
    empty abort output and be counted twice)."""
    sched, _ = make()
    sched.add_request(req("a", list(range(10))))
    outputs = sched.step()  # a's prefill is submitted (in flight under overlap)
    sched.add_request(req("b", list(range(100, 110))))
    assert sched.abort("a")
    results = run(sched, results=collect({}, outputs))
    finished = [o for o in results["a"].outputs if o.finished]
    assert len(finished) == 1 and finished[0].finish_reason.type == "abort"
    assert sched.stats.num_finished == 2 and sched.stats.num_aborted == 1


def test_a_request_done_on_its_first_token_leaves_the_running_set():
    sched, _ = make()
    sched.add_request(req("a", list(range(10)), 1))
    sched.add_request(req("b", list(range(100, 110)), 10))
    for _ in range(4):
        sched.step()
        if "a" not in sched.live:
            break
    assert "a" not in sched.live
    assert "a" not in [r.rid for r in sched.running]
    assert sched.metrics()["num_running_reqs"] == len(sched.running) <= 1
    run(sched)


def test_queue_time_ends_when_the_first_chunk_is_scheduled():
    """Queue time is the wait before the first prefill chunk. It was measured up to the first
    token, so a chunked prompt on an idle server reported its whole prefill as queueing."""
    import time

    sched, runner = make(chunked_prefill_size=8)
    forward = runner.forward

    def slow_forward(batch):
        time.sleep(0.05)
        return forward(batch)

    runner.forward = slow_forward
    submitted = time.perf_counter()
    results = run(sched, [req("a", list(range(1, 81)), 2)])  # 10 chunks of 8 tokens
    first = next(out for out in results["a"].outputs if out.new_token_ids)
    assert time.perf_counter() - submitted >= 10 * 0.05
    assert first.queue_time is not None and first.queue_time < 0.25
    assert all(out.queue_time == first.queue_time for out in results["a"].outputs)


def test_health_probes_are_served_but_not_counted():
    """The router's /health (every 10 s per replica) is a real one-token generation; it moved
    every counter of an idle replica, and one cut at the health timeout counted as an aborted
    request, firing alerts on aborts with no client affected."""
    sched, _ = make(pool=512)
    probes = [req(f"health-{i}", [1], 1, probe=True) for i in range(3)]
    cut = req("health-cut", [1], 50, probe=True)
    results = {}
    for r in [req("client", list(range(10, 40)), 3), *probes, cut]:
        sched.add_request(r)
    collect(results, sched.step())
    sched.abort("health-cut")  # the health timeout cut it
    run(sched, results=results)
    assert all(results[r.rid].outputs[-1].finished for r in probes)  # probes are served
    assert len(results["client"].tokens) == 3
    m = sched.metrics()
    assert (m["num_requests_total"], m["num_aborted_requests_total"]) == (1, 0)
    assert (m["prompt_tokens_total"], m["generation_tokens_total"]) == (30, 3)
