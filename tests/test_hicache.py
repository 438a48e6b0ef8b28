"""The hierarchical cache: a host-memory KV tier under the radix tree (scheduler/hicache.py,
worker/host_pool.py) and the L3 storage interface (scheduler/hicache_storage.py).

Scheduler tests run against FakeRunner, whose tokens are a hash of the context read back
through the KV slots: a missing, late or misdirected tier copy changes the generated tokens.
The worker side and the Engine are in test_hicache_worker.py.
Every scheduler checks the per-tier memory invariant after every step (debug_invariants).
"""

from __future__ import annotations

import argparse
import os
import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_runner import FakeRunner, OverlapFakeRunner, reference_tokens, run_random_workload
from radixray.cluster.metrics import EngineMetrics
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.hicache import HiRadixCache
from radixray.scheduler.hicache_storage import LocalDiskStorage, prefix_hashes
from radixray.scheduler.memory_pool import TokenToKVPoolAllocator
from radixray.scheduler.radix_cache import RadixKey
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.sampling_params import SamplingParams


# ---------------------------------------------------------------------------- the tree alone
def make_tree(device=64, host=128, page=1, policy="write_through"):
    return HiRadixCache(TokenToKVPoolAllocator(device, page), TokenToKVPoolAllocator(host, page),
                        page, write_policy=policy)


def insert(tree, tokens):
    """Insert like a finished request: fresh device slots; our duplicates are freed."""
    slots = tree.allocator.alloc(len(tokens))
    already = tree.insert(RadixKey(tokens), slots)
    tree.allocator.free(slots[:already])
    return slots


def host_only(tree, tokens):
    """Cache ``tokens``, then evict them from the device (their host copy stays); the store
    is taken as sent."""
    insert(tree, tokens)
    tree.evict(len(tokens))
    tree.take_copies()


def test_write_through_copies_on_insert_and_eviction_keeps_the_node_on_host():
    tree = make_tree()
    slots = insert(tree, list(range(10)))
    stores, loads, _ = tree.take_copies()
    assert torch.equal(stores[0], slots) and loads is None and tree.host_size() == 10
    assert tree.evict(10) == 10
    assert tree.total_size() == 0 and tree.host_size() == 10
    result, host_nodes = tree.match_tiers(RadixKey(list(range(12))))
    assert len(result.indices) == 0 and sum(len(n.key) for n in host_nodes) == 10
    assert tree.take_copies() == (None, None, None)  # evicting a backed-up node copies nothing
    tree.check_tiers()


def test_full_host_pool_drops_old_device_nodes_copies_for_new_ones():
    """write_through with a host pool smaller than what the device holds: every new prefix
    still gets its host copy; the least recently used device node gives its copy up."""
    tree = make_tree(device=64, host=24)
    old, mid = list(range(10)), list(range(100, 110))
    insert(tree, old)
    insert(tree, mid)
    tree.match_prefix(RadixKey(old))  # old is now the more recently used
    tree.take_copies()
    new = list(range(200, 210))
    insert(tree, new)  # 20 host slots held; 10 more needed: mid's copy goes
    assert tree.stats.backup_failed == 0
    nodes = {tuple(t[:1]): tree.match_prefix(RadixKey(t)).last_node for t in (old, mid, new)}
    assert nodes[(100,)].host_value is None and nodes[(100,)].value is not None
    assert nodes[(0,)].host_value is not None and nodes[(200,)].host_value is not None
    (device, host), _, _ = tree.take_copies()
    assert len(device) == 10 and tree.host_size() == 20
    tree.check_tiers()
    assert tree.evict(64) == 30  # mid leaves the tree; old and new stay on the host
    assert tree.host_size() == 20 and tree.total_size() == 0
    tree.check_tiers()


def test_a_node_being_loaded_keeps_its_host_copy():
    tree = make_tree(device=64, host=20)
    first = list(range(10))
    host_only(tree, first)
    result, host_nodes = tree.match_tiers(RadixKey(first))
    job = tree.start_load(host_nodes)  # queued, not in a batch yet
    assert len(job.device_slots) == 10 and tree.loading_size() == 10
    insert(tree, list(range(50, 60)))  # host full: 10 + 10 of 20
    insert(tree, list(range(70, 80)))  # needs room: first's copy is loading, so no drop of it
    node = host_nodes[0]
    assert node.host_value is not None and node.parent is not None
    stores, loads, _ = tree.take_copies()
    assert torch.equal(loads[0], node.host_value)
    tree.check_tiers()


def test_write_back_copies_only_on_eviction():
    tree = make_tree(policy="write_back")
    slots = insert(tree, list(range(10)))
    assert tree.take_copies() == (None, None, None) and tree.host_size() == 0
    tree.evict(10)
    (device, host), loads, _ = tree.take_copies()
    assert torch.equal(device, slots) and len(host) == 10 and loads is None
    tree.check_tiers()


def test_a_host_hit_below_the_load_threshold_is_computed():
    tree = make_tree()
    host_only(tree, list(range(9)))
    _, host_nodes = tree.match_tiers(RadixKey(list(range(9)) + [99]))
    assert len(host_nodes) == 1 and tree.min_load_tokens == 10
    assert tree.start_load(host_nodes) is None and tree.loading_size() == 0
    tree.check_tiers()


def test_a_load_joins_the_tree_only_when_acknowledged():
    tree = make_tree()
    insert(tree, list(range(8)))
    host_slots = tree.match_prefix(RadixKey(list(range(8)))).last_node.host_value.clone()
    tree.evict(8)
    tree.take_copies()
    tree.min_load_tokens = 8
    result, host_nodes = tree.match_tiers(RadixKey(list(range(8)) + [99]))
    job = tree.start_load(host_nodes)
    assert tree.start_load(host_nodes) is job  # a second request waits for the same load
    stores, (host, device), ticket = tree.take_copies()
    assert stores is None and torch.equal(host, host_slots) and job.state == "sent"
    assert len(tree.match_prefix(RadixKey(list(range(8)))).indices) == 0  # not readable yet
    assert tree.total_size() == 0 and tree.loading_size() == 8
    tree.check_tiers()
    tree.ack_copies(ticket, stores_ok=True, loads_ok=True)
    result = tree.match_prefix(RadixKey(list(range(8))))
    assert torch.equal(result.indices, device) and tree.total_size() == 8
    assert job.state == "done" and tree.loading_size() == 0 and tree.stats.loaded == 8
    assert tree.evictable_size() == 8 and tree.protected_size() == 0
    tree.check_tiers()


def test_locked_parent_with_host_only_children_is_not_evicted():
    tree = make_tree()
    insert(tree, list(range(4)))
    insert(tree, list(range(4)) + [7, 7, 7])
    tree.evict(3)  # the [7, 7, 7] leaf goes to the host; its parent is now a device leaf
    parent = tree.match_prefix(RadixKey(list(range(4)))).last_node
    tree.inc_lock_ref(parent)
    assert tree.evict(100) == 0 and tree.total_size() == 4
    tree.dec_lock_ref(parent)
    assert tree.evict(100) == 4
    tree.check_tiers()


def test_insert_over_host_only_nodes_adopts_the_new_slots():
    tree = make_tree()
    host_only(tree, list(range(6)))
    slots = tree.allocator.alloc(9)
    # nothing on the device matched: the caller owns no duplicates, the tree took all 9
    assert tree.insert(RadixKey(list(range(9))), slots) == 0
    assert tree.total_size() == 9 and tree.host_size() == 9
    (device, _), _, _ = tree.take_copies()
    assert torch.equal(device, slots[6:])  # only the new leaf is copied out
    tree.check_tiers()


def test_host_pool_full_drops_unbacked_nodes_and_host_eviction_frees_lru():
    tree = make_tree(device=32, host=8, policy="write_back")
    insert(tree, [1] * 6)
    insert(tree, [2] * 6)
    tree.evict(6)  # [1]*6 goes to host (6 of 8 host slots)
    tree.evict(6)  # [2]*6 needs 6: host eviction drops [1]*6 first
    assert tree.stats.host_evicted == 6 and tree.host_size() == 6
    assert tree.match_tiers(RadixKey([1] * 6))[1] == []
    insert(tree, [3] * 10)  # longer than the whole host pool: cannot be backed up
    tree.evict(10)
    assert tree.stats.backup_failed == 10
    assert tree.match_tiers(RadixKey([3] * 10))[1] == []  # dropped: it will be recomputed
    tree.check_tiers()


def test_check_tiers_catches_a_host_slot_leak():
    tree = make_tree()
    insert(tree, list(range(5)))
    tree.host_allocator.alloc(3)  # taken, but nobody holds it
    with pytest.raises(AssertionError, match="host slot leak"):
        tree.check_tiers()


def test_reset_frees_both_tiers():
    tree = make_tree()
    insert(tree, list(range(5)))
    insert(tree, [9] * 4)
    tree.evict(4)
    tree.reset()
    assert tree.allocator.available_size() == 64 and tree.host_allocator.available_size() == 128
    assert tree.take_copies() == (None, None, None)


# ---------------------------------------------------------------------------- the scheduler
def multi_turn(runner_cls, policy="write_through", host=600, pool=300, page=1, turns=5,
               convs=6, seed=0, **cfg):
    """Conversations whose history (about 6 x 100 tokens by the end) outgrows the device
    pool; every output is checked against the plain reference."""
    runner = runner_cls(pool, 16, 4096, page, host_pool_tokens=host)
    sched = Scheduler(SchedulerConfig(page_size=page, debug_invariants=True,
                                      enable_hierarchical_cache=True,
                                      hicache_write_policy=policy, **cfg), runner)
    rng = random.Random(seed)
    history = [[rng.randrange(1000) for _ in range(40)] for _ in range(convs)]
    host_hits = 0
    for turn in range(turns):
        reqs = []
        for c, h in enumerate(history):
            h += [rng.randrange(1000) for _ in range(10)]
            reqs.append(Req(f"t{turn}-{c}", list(h), SamplingParams(max_new_tokens=8)))
        for r in reqs:
            sched.add_request(r)
        outs = {r.rid: [] for r in reqs}
        while sched.has_work:
            for o in sched.step():
                outs[o.rid] += o.new_token_ids
                host_hits += o.host_cached_tokens if o.finished else 0
        for c, r in enumerate(reqs):
            assert outs[r.rid] == reference_tokens(r.origin_input_ids, 8), r.rid
            history[c] = r.origin_input_ids + outs[r.rid]
    sched.check_invariant()
    assert sched.cache.tree.protected_size() == 0
    return sched, runner, host_hits


@pytest.mark.parametrize("runner_cls", [FakeRunner, OverlapFakeRunner], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 4])
def test_multi_turn_history_comes_back_from_host(runner_cls, policy, page):
    sched, runner, host_hits = multi_turn(runner_cls, policy, page=page)
    _, plain, _ = multi_turn(runner_cls, policy, host=0, page=page)
    assert sched.cache.hicache is not None
    assert host_hits > 0 and runner.tokens_loaded >= host_hits
    assert sched.metrics()["host_cached_tokens_total"] == host_hits
    assert runner.tokens_computed < 0.6 * plain.tokens_computed  # history is not recomputed


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_tiny_host_pool_falls_back_to_recompute(policy):
    sched, runner, _ = multi_turn(OverlapFakeRunner, policy, host=24)
    assert sched.cache.hicache.stats.backup_failed > 0  # the host pool ran out, often


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_with_chunks_retractions_and_aborts(seed):
    """Shared and growing prefixes, aborts, small pools (retraction), chunked prefill, mixed
    chunks, queue policies and page sizes drawn at random; outputs must equal the reference."""
    rng = random.Random(seed)
    page, pool = rng.choice([1, 2, 4]), rng.choice([120, 200, 400])
    runner = rng.choice([FakeRunner, OverlapFakeRunner])(
        pool, rng.choice([4, 16]), 4096, page, host_pool_tokens=rng.choice([16, 100, 1200]))
    sched = Scheduler(SchedulerConfig(
        page_size=page, debug_invariants=True, enable_hierarchical_cache=True,
        hicache_write_policy=rng.choice(["write_through", "write_back"]),
        schedule_policy=rng.choice(["fcfs", "lpm", "dfs-weight"]),
        chunked_prefill_size=rng.choice([None, 16, 64]), enable_mixed_chunk=rng.random() < 0.3,
        radix_eviction_policy=rng.choice(["lru", "lfu", "slru"])), runner)
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(10, 60))] for _ in range(5)]

    def make_prompt(rng):
        base = rng.choice(bases)
        prompt = (base[: rng.randrange(1, len(base) + 1)]
                  + [rng.randrange(1000) for _ in range(rng.randrange(30))])[: pool - 20]
        if rng.random() < 0.3:
            bases.append(prompt)  # a later turn extends this one
        return prompt

    run_random_workload(sched, rng, make_prompt, steps=400, max_reqs=60, max_new=30)


def test_flag_off_or_no_host_pool_means_plain_radix_cache():
    runner = FakeRunner(300, 16, 4096, host_pool_tokens=600)
    assert Scheduler(SchedulerConfig(), runner).cache.hicache is None
    runner = FakeRunner(300, 16, 4096)  # the runner could not allocate a host pool
    sched = Scheduler(SchedulerConfig(enable_hierarchical_cache=True), runner)
    assert sched.cache.hicache is None


def test_flush_cache_empties_the_host_tier():
    sched, _, _ = multi_turn(FakeRunner, turns=2)
    assert sched.cache.hicache.host_size() > 0
    assert sched.flush_cache()
    host = sched.cache.hicache.host_allocator
    assert sched.cache.hicache.host_size() == 0 and host.available_size() == host.size


@pytest.mark.parametrize("field, value", [("hicache_write_policy", "later"),
                                          ("hicache_ratio", -1), ("hicache_size", "big"),
                                          ("enable_hierarchical_cache", "yes")])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_serve_flags_reach_the_server_args():
    from radixray.cluster.serve import add_serve_arguments, server_args_from

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = server_args_from(p.parse_args([
        "--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-size", "0.5",
        "--hicache-write-policy", "write_back"]))
    assert args["enable_hierarchical_cache"] is True and args["hicache_ratio"] == 3.0
    assert args["hicache_size"] == 0.5 and args["hicache_write_policy"] == "write_back"


def test_host_hit_counter_is_exported():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", 0)
    metrics.update_scheduler_stats({"host_cached_tokens_total": 42})
    assert registry.get_sample_value("radixray:host_cached_tokens_total",
                                     {"model_name": "m", "replica": "0"}) == 42


def test_http_meta_info_splits_cached_tokens(tiny_llama_path):
    """The server path carries the split too: RequestOutput -> TokenOutput -> meta_info."""
    from transformers import AutoTokenizer

    from radixray.cluster.async_engine import to_token_output
    from radixray.cluster.detokenizer import IncrementalDetokenizer
    from radixray.cluster.engine_protocol import GenerateRequest
    from radixray.cluster.generation import RequestState
    from radixray.cluster.native_api import native_result
    from radixray.scheduler.request import FinishReason, RequestOutput

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    state = RequestState(GenerateRequest("r", [5, 6, 7, 8], SamplingParams()),
                         IncrementalDetokenizer(tokenizer))
    state.apply(to_token_output(RequestOutput("r", [9], True, FinishReason.of_length(1), 4, 3,
                                              1, host_cached_tokens=2)))
    meta = native_result(state, tokenizer, False)["meta_info"]
    assert meta["cached_tokens"] == 3 and meta["cached_tokens_details"] == {"device": 1, "host": 2}


# ---------------------------------------------------------------------------- L3 storage
def test_prefix_hashes_chain_over_pages_and_extra_key():
    a = prefix_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partial last page has no key
    assert prefix_hashes(list(range(8)), 4) == a
    assert prefix_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == a[0]
    assert prefix_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[1] != a[1]
    assert prefix_hashes([5, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # a page depends on the past
    assert prefix_hashes(list(range(8)), 4, extra_key="lora")[0] != a[0]
    with pytest.raises(ValueError, match="page_size"):
        prefix_hashes([1], 0)


def test_local_disk_storage(tmp_path):
    store = LocalDiskStorage(str(tmp_path / "l3"))
    keys = prefix_hashes(list(range(12)), 4)
    page = torch.randn(4, 2, 2, 3)
    assert not store.exists(keys[0]) and store.get(keys[0]) is None
    assert store.put(keys[0], page) and store.put(keys[1], page * 2)
    assert store.exists(keys[0]) and torch.equal(store.get(keys[1]), page * 2)
    assert store.matched_pages(keys) == 2
    with open(os.path.join(store.root, keys[0] + ".pt"), "wb") as f:
        f.write(b"not a tensor")
    assert store.get(keys[0]) is None  # unreadable: a miss, never garbage
    with pytest.raises(ValueError, match="key"):
        store.get("../etc/passwd")
    assert not [n for n in os.listdir(store.root) if n.endswith(".tmp")]
