"""The scheduler test harness: a Scheduler over FakeRunner, run to the end with its ledgers
checked, and the shared-prefix workload. Modules that use it mark their tests with
``pytest.mark.usefixtures("runner_kind")`` (conftest.py), so every test runs twice: one batch
at a time, and with overlap scheduling."""

from __future__ import annotations

import random

import torch

from fake_runner import FakeRunner, OverlapFakeRunner, reference_tokens
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.radix_cache import RadixCache, RadixKey
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.sampling_params import SamplingParams

RUNNER = FakeRunner  # set per test by runner_kind


def use_runner(kind: str) -> None:
    """``make`` builds schedulers over FakeRunner ("sync": one batch at a time) or
    OverlapFakeRunner ("overlap": batch N+1 built and submitted before batch N's tokens are
    processed); conftest's ``runner_kind`` fixture calls this."""
    global RUNNER
    RUNNER = FakeRunner if kind == "sync" else OverlapFakeRunner


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
