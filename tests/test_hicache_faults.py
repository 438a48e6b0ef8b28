"""Hierarchical-cache copies that fail degrade to recomputation: never a wrong token, a crash,
a leaked slot or a broken tier invariant (scheduler/hicache_copies.py and the scheduler's
loading queue; the worker side is in test_hicache_faults_engine.py).

A failing copy here also leaves garbage behind (in the host slots a store was writing, in the
device slots a load was writing), so any use of what it was copying changes the outputs.
Scheduler tests run FakeRunner (tokens hash the context read back through the KV slots), which
fails copies on request; every scheduler checks both tiers' invariants after every step.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_runner import VOCAB, FakeRunner, OverlapFakeRunner, reference_tokens, run_random_workload
from radixray.cluster.metrics import EngineMetrics
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.hicache import HiRadixCache
from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
from radixray.scheduler.radix_cache import RadixKey
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.forward_batch import ForwardBatch
from radixray.worker.sampling_params import SamplingParams


# ---------------------------------------------------------------------------- the tree alone
def make_tree(device=64, host=128, policy="write_through"):
    return HiRadixCache(TokenToKVPoolAllocator(device), TokenToKVPoolAllocator(host),
                        write_policy=policy)


def insert(tree, tokens):
    slots = tree.allocator.alloc(len(tokens))
    already = tree.insert(RadixKey(tokens), slots)
    tree.allocator.free(slots[:already])
    return slots


def settle(tree, stores_ok=True, loads_ok=True):
    """Send what is queued as one batch and acknowledge it."""
    ticket = tree.take_copies()[2]
    if ticket is not None:
        tree.ack_copies(ticket, stores_ok, loads_ok)
    return ticket


def host_only_path(policy="write_through"):
    """A tree whose only prefix (tokens 0..9) was stored to the host (confirmed under
    write_through; queued, unconfirmed, under write_back) and evicted from the device."""
    tree = make_tree(policy=policy)
    a = list(range(10))
    insert(tree, a)
    if policy == "write_through":
        settle(tree)
    tree.evict(10)
    return tree, a


def assert_empty(tree, device=64, host=128):
    tree.check_tiers()
    assert tree.allocator.available_size() + tree.total_size() == device
    assert tree.host_allocator.available_size() == host and tree.host_size() == 0
    assert tree.loading_size() == 0 and tree.protected_size() == 0


def test_failed_store_drops_a_device_copy_and_removes_a_host_only_node():
    tree = make_tree()
    a, b = list(range(10)), list(range(100, 110))
    insert(tree, a)
    insert(tree, b)
    tree.match_prefix(RadixKey(b))
    tree.evict(10)  # a (least recently used) is on the host only, its store not confirmed
    settle(tree, stores_ok=False)
    result, host_nodes = tree.match_tiers(RadixKey(a))
    assert len(result.indices) == 0 and host_nodes == []  # gone: recomputed when needed
    node = tree.match_prefix(RadixKey(b)).last_node
    assert node.value is not None and node.host_value is None  # still cached on the device
    assert tree.stats.store_failures == 1 and tree.stats.failed_tokens == 20
    assert_empty(tree)


def test_failed_load_frees_its_slots_and_drops_the_host_copy():
    tree, a = host_only_path()
    _, host_nodes = tree.match_tiers(RadixKey(a))
    job = tree.start_load(host_nodes)
    assert tree.loading_size() == 10 and tree.allocator.available_size() == 54
    settle(tree, loads_ok=False)
    assert job.state == "failed" and tree.stats.load_failures == 1
    assert tree.match_tiers(RadixKey(a))[1] == []  # the suspect copy is gone: recompute
    assert_empty(tree)


@pytest.mark.parametrize("same_batch", [True, False], ids=["same_batch", "next_batch"])
def test_a_load_that_read_a_failed_store_fails_too(same_batch):
    """write_back: the store leaves with the eviction, the load of the same node follows in
    the same batch or the next one; the load itself 'succeeds' but read garbage."""
    tree, a = host_only_path("write_back")
    store_ticket = None if same_batch else tree.take_copies()[2]
    job = tree.start_load(tree.match_tiers(RadixKey(a))[1])
    assert job is not None
    load_ticket = tree.take_copies()[2]
    if store_ticket is not None:
        tree.ack_copies(store_ticket, stores_ok=False)
        assert job.suspect and job.state == "sent"
        tree.ack_copies(load_ticket)
    else:
        tree.ack_copies(load_ticket, stores_ok=False, loads_ok=True)
    assert job.state == "failed" and tree.match_tiers(RadixKey(a))[1] == []
    assert_empty(tree)


def test_split_of_a_loading_node_gives_both_halves_their_slots():
    tree, a = host_only_path()
    job = tree.start_load(tree.match_tiers(RadixKey(a))[1])
    tree.match_tiers(RadixKey(a[:4] + [999]))  # splits the loading node after 4 tokens
    assert len(job.nodes) == 2
    _, (_, device), ticket = tree.take_copies()
    tree.ack_copies(ticket)
    assert torch.equal(tree.match_prefix(RadixKey(a)).indices, device)
    assert torch.equal(tree.match_prefix(RadixKey(a[:4])).indices, device[:4])
    tree.check_tiers()


def test_split_of_a_node_whose_store_failed_drops_both_halves():
    tree, a = host_only_path("write_back")
    ticket = tree.take_copies()[2]
    tree.match_tiers(RadixKey(a[:6] + [999]))  # splits the host-only node
    tree.ack_copies(ticket, stores_ok=False)
    assert tree.match_tiers(RadixKey(a))[1] == []
    assert_empty(tree)


def test_insert_over_a_loading_path_frees_the_loads_surplus_slots():
    tree, a = host_only_path()
    job = tree.start_load(tree.match_tiers(RadixKey(a))[1])
    computed = insert(tree, a)  # another request computed the same tokens meanwhile
    settle(tree, loads_ok=True)
    assert job.state == "done" and torch.equal(tree.match_prefix(RadixKey(a)).indices, computed)
    assert tree.allocator.available_size() == 54 and tree.loading_size() == 0
    tree.check_tiers()


def test_reset_refuses_while_a_load_is_pending():
    tree, a = host_only_path()
    tree.start_load(tree.match_tiers(RadixKey(a))[1])
    with pytest.raises(RuntimeError, match="pending loads"):
        tree.reset()
    settle(tree)
    tree.reset()
    assert_empty(tree)


# ---------------------------------------------------------------------------- the scheduler
def faulty(base):
    """``base`` FakeRunner whose n-th batch with stores (loads) fails them when
    ``fail_store(n)`` (``fail_load(n)``) is true, leaving garbage where they were writing."""

    class Faulty(base):
        def __init__(self, *args, fail_store=lambda n: False, fail_load=lambda n: False, **kw):
            super().__init__(*args, **kw)
            self.fail_store, self.fail_load = fail_store, fail_load
            self.store_batches = self.load_batches = self.failed = 0

        def forward(self, batch: ForwardBatch):
            stores_ok = loads_ok = True
            if batch.kv_store is not None:
                self.store_batches += 1
                if self.fail_store(self.store_batches):
                    device, host = batch.kv_store
                    self.host_kv[host] = (self.kv[device] + 1) % VOCAB
                    stores_ok, batch = False, dataclasses.replace(batch, kv_store=None)
            failed_load = None
            if batch.kv_load is not None:
                self.load_batches += 1
                if self.fail_load(self.load_batches):
                    failed_load, batch = batch.kv_load, dataclasses.replace(batch, kv_load=None)
            out = super().forward(batch)
            if failed_load is not None:  # after the stores, as on a worker
                host, device = failed_load
                self.kv[device] = (self.host_kv[host] + 1) % VOCAB
                loads_ok = False
            self.failed += (not stores_ok) + (not loads_ok)
            out.kv_store_ok, out.kv_load_ok = stores_ok, loads_ok
            return out

    return Faulty


def chats(runner, policy="write_through", turns=6, convs=6, seed=0, max_new_tokens=8):
    """Conversations whose history (~6 x 110 tokens by the end) outgrows the 300-token device
    pool; every output is checked against the plain reference. Returns the scheduler and
    the host-hit tokens of each turn."""
    sched = Scheduler(SchedulerConfig(debug_invariants=True, enable_hierarchical_cache=True,
                                      hicache_write_policy=policy), runner)
    rng = random.Random(seed)
    history = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(convs)]
    hits = []
    for turn in range(turns):
        reqs = []
        for c, h in enumerate(history):
            h += [rng.randrange(VOCAB) for _ in range(10)]
            reqs.append(Req(f"t{turn}-{c}", list(h), SamplingParams(max_new_tokens=max_new_tokens)))
            sched.add_request(reqs[-1])
        outs, host = {r.rid: [] for r in reqs}, 0
        while sched.has_work:
            for o in sched.step():
                outs[o.rid] += o.new_token_ids
                host += o.host_cached_tokens if o.finished else 0
        for c, r in enumerate(reqs):
            assert outs[r.rid] == reference_tokens(r.origin_input_ids, max_new_tokens), r.rid
            history[c] = r.origin_input_ids + outs[r.rid]
        hits.append(host)
    sched.check_invariant()
    tree = sched.cache.hicache
    assert tree.protected_size() == 0 and tree.loading_size() == 0 and not sched.loading
    return sched, hits


RUNNERS = [FakeRunner, OverlapFakeRunner]


@pytest.mark.parametrize("base", RUNNERS, ids=["sync", "overlap"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind", ["store", "load"])
def test_every_copy_failing_still_gives_the_right_tokens(base, policy, kind):
    runner = faulty(base)(300, 16, 4096, host_pool_tokens=600,
                          **{f"fail_{kind}": lambda n: True})
    sched, hits = chats(runner, policy)
    stats = sched.cache.hicache.stats
    assert runner.failed > 0 and sum(hits) == 0  # nothing came back from the host
    assert stats.store_failures + stats.load_failures == runner.failed
    assert sched.metrics()["hicache_copy_failures_total"] == runner.failed
    assert (stats.store_failures if kind == "store" else stats.load_failures) == runner.failed


@pytest.mark.parametrize("base", RUNNERS, ids=["sync", "overlap"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_hits_resume_after_failures_stop(base, policy):
    """Early stores and loads fail, then copies work again: later turns hit the host."""
    runner = faulty(base)(300, 16, 4096, host_pool_tokens=600, fail_store=lambda n: n <= 3,
                          fail_load=lambda n: n <= 2)
    sched, hits = chats(runner, policy, turns=7)
    assert runner.failed == 5 and sched.metrics()["hicache_copy_failures_total"] == 5
    assert hits[-1] > 0 and sched.stats.host_cached_tokens == sum(hits)


@pytest.mark.parametrize("seed", range(4))
def test_random_failures_random_workload(seed):
    """Random copy failures under retraction-sized pools, chunked prefill and aborts."""
    rng = random.Random(seed)
    runner = faulty(rng.choice(RUNNERS))(
        rng.choice([150, 300]), 8, 4096, host_pool_tokens=rng.choice([64, 600]),
        fail_store=lambda n: rng.random() < 0.3, fail_load=lambda n: rng.random() < 0.3)
    sched = Scheduler(SchedulerConfig(
        debug_invariants=True, enable_hierarchical_cache=True,
        hicache_write_policy=rng.choice(["write_through", "write_back"]),
        schedule_policy=rng.choice(["fcfs", "lpm"]),
        chunked_prefill_size=rng.choice([None, 32])), runner)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 60))] for _ in range(4)]

    def make_prompt(rng):
        prompt = rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        if rng.random() < 0.3:
            bases.append(prompt[:80])
        return prompt[:120]

    run_random_workload(sched, rng, make_prompt, steps=300, max_reqs=50, max_new=20)
    assert sched.cache.hicache.loading_size() == 0 and sched.cache.tree.protected_size() == 0


def test_abort_while_loading_leaves_the_load_to_finish():
    runner = OverlapFakeRunner(300, 16, 4096, host_pool_tokens=600)
    sched, _ = chats(runner, turns=2, convs=4)
    sched.cache.tree.evict(10**6)  # every history is on the host only now
    history = next(iter(sched.cache.tree.root.children.values()))
    req = Req("late", list(history.key.token_ids) + [1, 2], SamplingParams(max_new_tokens=2))
    sched.add_request(req)
    copy_batches = sched.stats.num_copy_batches
    sched.step()  # the load rides a batch of copies only, still in flight
    assert sched.loading == [req] and req.load.state == "sent"
    assert sched.stats.num_copy_batches == copy_batches + 1
    assert sched.abort("late")
    assert req.finished and not sched.loading and not sched.live
    while sched.has_work:
        sched.step()
    sched.check_invariant()
    tree = sched.cache.hicache
    assert tree.loading_size() == 0 and tree.protected_size() == 0
    assert len(tree.match_prefix(RadixKey(list(history.key.token_ids))).indices) > 0  # loaded


def test_copy_failure_counter_is_exported():
    registry = CollectorRegistry()
    EngineMetrics(registry, "m", 0).update_scheduler_stats({"hicache_copy_failures_total": 3})
    assert registry.get_sample_value("radixray:hicache_copy_failures_total",
                                     {"model_name": "m", "replica": "0"}) == 3
