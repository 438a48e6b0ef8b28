"""Unit tests of the scheduler's small parts: config, token ratio, prefill budgets, policies,
in-batch sharing, stop checks and the request record."""

from __future__ import annotations

import pytest
import torch

from radixray.scheduler.cache_manager import CacheManager
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.policy import DfsWeightPolicy, InBatchPrefixSharing, QueueView
from radixray.scheduler.prefill_adder import AddResult, PrefillAdder
from radixray.scheduler.request import FinishReason, Req
from radixray.scheduler.stop import StopChecker, visible_output_ids
from radixray.scheduler.token_ratio import NewTokenRatio
from radixray.worker.sampling_params import SamplingParams


def req(rid, prompt, max_new=8, **kw):
    params = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__dataclass_fields__}
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new, **params), **kw)


# ---------------------------------------------------------------- config and request
@pytest.mark.parametrize("name,value", [
    ("schedule_policy", "shortest"), ("schedule_conservativeness", 0),
    ("chunked_prefill_size", 0), ("max_prefill_tokens", -5), ("max_total_tokens", 0),
    ("max_running_requests", 1.5), ("page_size", 0), ("radix_eviction_policy", "lifo"),
    ("disable_radix_cache", "yes"), ("enable_mixed_chunk", 1), ("schedule_max_wait", -1),
    ("schedule_max_wait", float("inf")),
])
def test_config_errors_name_the_argument(name, value):
    with pytest.raises(ValueError, match=f"^{name}: "):
        SchedulerConfig(**{name: value})


def test_unset_random_seed_is_drawn_per_config():
    # SGLang draws one: a fixed default made every fresh start repeat its unseeded samples.
    seeds = {SchedulerConfig().random_seed for _ in range(8)}
    assert all(isinstance(s, int) for s in seeds) and len(seeds) > 1
    assert SchedulerConfig(random_seed=7).random_seed == 7
    with pytest.raises(ValueError, match="^random_seed: "):
        SchedulerConfig(random_seed="7")


def test_config_chunk_size():
    assert SchedulerConfig().chunk_size == 2048
    assert SchedulerConfig(chunked_prefill_size=-1).chunk_size is None
    assert SchedulerConfig(chunked_prefill_size=None).chunk_size is None


def test_request_validation_names_fields():
    with pytest.raises(ValueError, match="^input_ids: "):
        Req("a", [])
    with pytest.raises(ValueError, match="^input_ids: "):
        Req("a", [1, -2])
    with pytest.raises(ValueError, match="^logprob_start_len: "):
        Req("a", [1, 2], return_logprob=True, logprob_start_len=2)
    with pytest.raises(ValueError, match="^rid: "):
        Req("", [1])


def test_finish_reason_wire_forms():
    assert FinishReason.stop(7).to_dict() == {"type": "stop", "matched": 7}
    assert FinishReason.stop("\n\n").to_dict() == {"type": "stop", "matched": "\n\n"}
    assert FinishReason.of_length(5).to_dict() == {"type": "length", "length": 5}
    assert FinishReason.abort("gone").to_dict() == {"type": "abort", "message": "gone"}


def test_request_length_vocabulary():
    r = req("a", [1, 2, 3, 4], return_logprob=True, logprob_start_len=1)
    r.output_ids += [5, 6]
    assert r.total_len == 6 and r.tokens(2, 5) == [3, 4, 5] and r.tokens(4, 6) == [5, 6]
    assert r.max_prefix_len() == 1  # input logprobs from position 1 still owed
    r.input_logprobs_pending = False
    assert r.max_prefix_len() == 5  # the last token is always recomputed


# ---------------------------------------------------------------- token ratio
def test_new_token_ratio_decays_linearly_and_jumps_after_retraction():
    ratio = NewTokenRatio(conservativeness=1.0)
    assert ratio.value == pytest.approx(0.7)
    for _ in range(300):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx((0.7 + 0.098) / 2)
    for _ in range(1000):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx(0.7 * 0.14)  # the floor is a share of the start
    running = [req("a", [1], 100), req("b", [1], 300)]
    running[0].output_ids += [0] * 30
    ratio.on_retract(running)
    assert ratio.value == pytest.approx((30 + 20 * 2) / (400 + 1))
    ratio.on_retract([req("c", [1], 10)])
    assert ratio.value == 1.0  # capped
    ratio.on_idle()
    assert ratio.value == pytest.approx(0.7)
    # Conservativeness scales the start, capped at the whole max_new_tokens (1.0): a request
    # never reserves more than it can use, so one that fits even at worst is not kept waiting.
    assert NewTokenRatio(0.5).value == pytest.approx(0.35)
    assert NewTokenRatio(0.5).min == pytest.approx(0.35 * 0.14)
    assert NewTokenRatio(2.0).value == 1.0 and NewTokenRatio(2.0).min == pytest.approx(0.14)


# ---------------------------------------------------------------- prefill adder
def cache_with(pool, cached_tokens=()):
    cache = CacheManager(pool, max_running_requests=8, max_context_len=512)
    if cached_tokens:  # cache a sequence as a finished request would
        warm = req("warm", list(cached_tokens) + [0], 1)
        cache.match(warm)
        cache.lock(warm)
        cache.assign_row(warm)
        warm.extend_len = len(cached_tokens)
        cache.alloc_extend([warm])
        warm.cached_len, warm.extend_len = len(cached_tokens), 0
        cache.cache_finished(warm)
    return cache


def test_rem_total_counts_free_evictable_and_running_reservations():
    cache = cache_with(1000, range(60))
    running = [req("r1", [1], 100), req("r2", [1], 5000)]  # 5000 is clipped to 4096
    adder = PrefillAdder(cache, running, new_token_ratio=0.5, chunk_size=None,
                         max_prefill_tokens=16384)
    assert cache.available_size() == 940 and cache.evictable_size() == 60
    assert adder.rem_total_tokens == pytest.approx(1000 - 0.5 * (100 + 4096))


def test_locking_the_matched_prefix_is_rechecked():
    cache = cache_with(100, range(60))  # 60 cached (evictable) + 40 free
    someone = [req("run", [1], 1)]
    adder = PrefillAdder(cache, someone, new_token_ratio=0.0, chunk_size=None,
                         max_prefill_tokens=1000)
    big = req("big", list(range(60)) + [7] * 36, 8)  # 36 new + 8 reserved = 44: fits only if
    cache.match(big)                                 # the 60 cached still count as free
    assert big.tree_len == 60
    assert adder.add_one_req(big) is AddResult.NO_TOKEN
    assert cache.tree.protected_size() == 0 and not adder.can_run  # lock given back
    small = req("small", list(range(60)) + [7] * 25, 8)  # 25 + 8 = 33 < 40
    cache.match(small)
    assert adder.add_one_req(small) is AddResult.CONTINUE
    assert adder.can_run == [small] and small.extend_len == 25
    assert cache.tree.protected_size() == 60


def test_chunk_budget_cuts_a_long_prompt_and_it_continues():
    cache = cache_with(4096)
    adder = PrefillAdder(cache, [], 0.7, chunk_size=100, max_prefill_tokens=16384)
    long = req("long", list(range(250)), 4)
    cache.match(long)
    assert adder.add_one_req(long) is AddResult.OTHER  # the chunk budget is used up
    assert long.extend_len == 100 and adder.new_chunked_req is long
    cache.assign_row(long)
    long.cached_len, long.extend_len = 100, 0  # as if the chunk ran
    nxt = PrefillAdder(cache, [], 0.7, chunk_size=100, max_prefill_tokens=16384,
                       has_chunked_req=True)
    assert nxt.add_chunked_req(long) is long and long.extend_len == 100
    long.cached_len, long.extend_len = 200, 0
    last = PrefillAdder(cache, [], 0.7, chunk_size=100, max_prefill_tokens=16384,
                        has_chunked_req=True)
    assert last.add_chunked_req(long) is None and long.extend_len == 50


def test_max_prefill_tokens_lets_only_the_first_request_exceed_it():
    cache = cache_with(4096)
    adder = PrefillAdder(cache, [], 0.7, chunk_size=None, max_prefill_tokens=50)
    a, b = req("a", list(range(80)), 4), req("b", list(range(100, 110)), 4)
    for r in (a, b):
        cache.match(r)
    assert adder.add_one_req(a) is AddResult.OTHER and adder.can_run == [a]
    assert adder.add_one_req(b) is AddResult.OTHER and adder.can_run == [a]


def test_a_lone_requests_output_is_reserved_against_the_requests_after_it():
    """The first request into an idle scheduler needs only its prompt to fit, but its output
    went unreserved for the rest of the round: five 20-token prompts of 100 new tokens on a
    300-token pool admitted three where two fit, then retracted one (81 tokens recomputed)."""
    cache = cache_with(300)
    adder = PrefillAdder(cache, [], new_token_ratio=1.0, chunk_size=None,
                         max_prefill_tokens=16384)
    reqs = [req(f"r{i}", list(range(i * 100, i * 100 + 20)), 100) for i in range(5)]
    results = []
    for r in reqs:
        cache.match(r)
        results.append(adder.add_one_req(r))
        if results[-1] is not AddResult.CONTINUE:
            break
    assert [r.rid for r in adder.can_run] == ["r0", "r1"]  # 2 x (20 + 100) fit in 300
    assert adder.reserved == 2 * 120
    huge = cache_with(300)  # alone, a request needs only its prompt to fit (then retraction)
    alone = PrefillAdder(huge, [], 1.0, chunk_size=None, max_prefill_tokens=16384)
    big = req("big", list(range(250)), 100)
    huge.match(big)
    assert alone.add_one_req(big) is AddResult.NO_TOKEN and alone.can_run == [big]


# ---------------------------------------------------------------- policies
def test_overdue_requests_go_first_under_orders_that_can_pass_them_over():
    """lpm sorted a request with no cache hit behind every request that hit, each round: with
    hitting requests arriving steadily it never ran (a probe: 600 steps, 410 others served)."""
    from radixray.scheduler.policy import OldestFirst, make_policy

    cache = cache_with(1000, range(100))
    now = [100.0]
    policy = OldestFirst(make_policy("lpm"), max_wait_s=10.0, clock=lambda: now[0])
    miss = req("miss", [999] * 20, 4)
    hits = [req(f"hit{i}", list(range(100)) + [i], 4) for i in range(3)]
    for r, t in zip([miss, *hits], [95.0, 96.0, 97.0, 98.0]):
        r.submitted_at = t
    waiting = [miss, *hits]
    policy.order(waiting, QueueView(cache, []))
    assert waiting[-1] is miss  # 5 s: the cache hits first
    now[0] = 106.5  # the miss and hit0 are overdue: first, oldest first; the rest by lpm
    policy.order(waiting, QueueView(cache, []))
    assert [r.rid for r in waiting[:2]] == ["miss", "hit0"]
    assert isinstance(make_policy("dfs-weight", max_wait_s=1.0), OldestFirst)
    for name in ("fcfs", "priority", "random"):  # arrival or explicit order: left alone
        assert not isinstance(make_policy(name, max_wait_s=1.0), OldestFirst)
    assert not isinstance(make_policy("lpm", max_wait_s=0), OldestFirst)  # 0: never



def test_in_batch_sharing_holds_back_only_cache_misses_that_share_enough():
    sharing = InBatchPrefixSharing()
    base = list(range(100))
    first, twin = req("1", base + [1], 4), req("2", base + [2], 4)
    short = req("3", base[:20] + [9] * 40, 4)
    salted = req("4", base + [3], 4, extra_key="other")
    assert not sharing.hold_back(first)
    assert sharing.hold_back(twin)
    assert not sharing.hold_back(short)  # shares only 20 tokens
    assert not sharing.hold_back(salted)  # another extra_key never shares
    hit = req("5", base[:60] + [4] * 10, 4)
    hit.prefix_indices = torch.arange(40)  # a 40-token cache hit; sharing saves only 20 more
    assert not sharing.hold_back(hit)
    more = req("6", base + [5], 4)
    more.prefix_indices = torch.arange(40)  # sharing saves 60 more than the cache hit
    assert sharing.hold_back(more)


def test_in_batch_sharing_counts_the_request_mid_chunk():
    sharing = InBatchPrefixSharing()
    base = list(range(300))
    sharing.add(req("chunked", base + [1], 4))
    later = req("later", base + [2], 4)
    later.prefix_indices = torch.arange(128)  # only the chunks done so far are cached
    assert sharing.hold_back(later)


def test_dfs_weight_groups_requests_by_shared_prefix_heaviest_first():
    cache = cache_with(4096, [1] * 40 + [2] * 40)
    for tokens in ([1] * 40 + [3] * 40, [5] * 40):
        w = req("w", tokens + [0], 1)
        cache.match(w)
        cache.lock(w)
        cache.assign_row(w)
        w.extend_len = len(tokens) - w.tree_len
        cache.alloc_extend([w])
        w.cached_len, w.extend_len = len(tokens), 0
        cache.cache_finished(w)
    a = [req(f"a{i}", [1] * 40 + [2] * 40 + [i + 10] * 5, 2) for i in range(3)]
    b = [req(f"b{i}", [1] * 40 + [3] * 40 + [i + 10] * 5, 2) for i in range(2)]
    c = [req("c0", [5] * 40 + [9] * 5, 2)]
    waiting = [c[0], b[0], a[0], b[1], a[1], a[2]]
    DfsWeightPolicy().order(waiting, QueueView(cache, []))
    assert [r.rid for r in waiting] == ["a0", "a1", "a2", "b0", "b1", "c0"]


# ---------------------------------------------------------------- stop checks
def test_stop_checker_order_and_limits():
    checker = StopChecker(eos_token_ids=[9], decode=None, max_context_len=10)
    r = req("a", [1, 2, 3], 3)
    r.output_ids += [4, 5, 9]
    assert checker.check(r) == FinishReason.stop(9)  # EOS as the last allowed token: a stop
    r.output_ids[-1] = 6
    assert checker.check(r) == FinishReason.of_length(3)
    r = req("b", [1, 2, 3], 10)
    r.output_ids += [4, 9]
    assert checker.check(r) == FinishReason.stop(9)
    r = req("c", [1, 2, 3], 10, min_new_tokens=3)
    r.output_ids += [4, 9]
    assert checker.check(r) is None
    r = req("d", [1] * 8, 10)
    r.output_ids += [4, 5]
    assert checker.check(r) == FinishReason.of_length(2)  # hit the context length
    r = req("e", [1], 10, stop=["x"])  # stop strings but no tokenizer: only this request ends
    r.output_ids.append(3)
    assert checker.check(r) == FinishReason.abort(
        "stop: cannot check this request's stop conditions (ValueError: stop: stop strings "
        "need a tokenizer to decode with)", status_code=400)


def test_a_stop_string_that_fails_in_the_check_ends_only_its_request():
    """A lone surrogate that reached the scheduler (the offline Engine, or a check the API
    missed) raised inside the loop: the engine stopped and every request failed."""
    checker = StopChecker(decode=lambda ids, **_: "".join(map(chr, ids)))
    r = req("a", [1], 10, stop=["\ud800"])
    r.output_ids.append(65)
    reason = checker.check(r)
    assert reason.type == "abort" and reason.status_code == 400
    assert "UnicodeEncodeError" in reason.message
    r = req("b", [1], 2, stop=["BC"])  # completed by the last allowed token: a stop
    r.output_ids += [66, 67]
    assert checker.check(r) == FinishReason.stop("BC")


def test_visible_output_ids_drop_a_matched_stop_token():
    assert visible_output_ids([1, 2, 9], FinishReason.stop(9), False) == [1, 2]
    assert visible_output_ids([1, 2, 9], FinishReason.stop(9), True) == [1, 2, 9]
    assert visible_output_ids([1, 2], FinishReason.of_length(2), False) == [1, 2]


def test_abort_many_ends_queued_requests_in_one_pass_and_flags_running_ones():
    """Aborts one by one scanned the waiting list each: 60k queued requests aborted in reverse
    took 77 s (a client dropping its big batch froze the replica); abort_many takes one pass."""
    import time

    from scheduler_harness import make, run

    sched, _ = make(pool=4096, running=2, chunked_prefill_size=64)
    reqs = [req(f"r{i}", [i % 500 + 1, 7, 8], 4) for i in range(20_000)]
    for r in reqs:
        sched.add_request(r)
    sched.step()  # two are admitted; the rest wait
    running = set(sched.live) - {r.rid for r in sched.waiting}
    assert len(running) == 2
    started = time.monotonic()
    assert sched.abort_many([r.rid for r in reversed(reqs)] + ["gone"]) == 20_000
    assert time.monotonic() - started < 5  # (one by one: ~6 s for 20k in this order)
    assert not sched.waiting and {r.rid for r in sched.live.values()} == running
    assert all(sched.live[rid].to_abort for rid in running)
    results = run(sched)  # the running ones end at the next step; the ledgers are clean
    assert {rid for rid, out in results.items()
            if out.last.finish_reason.type == "abort"} == {r.rid for r in reqs}
