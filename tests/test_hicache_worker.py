"""The hierarchical cache from the worker's side: the host KV pool's copies and sizing, and
the tiny Llama through the Engine (and tp=2 Ray workers) with the host tier on against off:
greedy outputs equal, later turns hit the host. The tree and the scheduler alone are in
test_hicache.py."""

from __future__ import annotations

import pytest
import torch

from helpers import multi_turn_chats
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.attention import KVCache
from radixray.worker.forward_batch import ForwardBatch
from radixray.worker.host_pool import HostKVPool, host_pool_tokens
from radixray.worker.sampling_params import SamplingParams


# ---------------------------------------------------------------------------- the worker side
def test_host_pool_round_trip_and_sizing():
    kv = KVCache(3, 17, 2, 4, torch.float32, "cpu", 2, 8)
    for k, v in zip(kv.k, kv.v):
        k.normal_()
        v.normal_()
    pool = HostKVPool(32, 1, 3, 2, 4, torch.float32, torch.device("cpu"))
    before = [(k[[3, 5, 9]].clone(), v[[3, 5, 9]].clone()) for k, v in zip(kv.k, kv.v)]
    batch = ForwardBatch(*[torch.empty(0, dtype=torch.int64)] * 8, sampling_params=[],
                         kv_store=(torch.tensor([3, 5, 9]), torch.tensor([30, 1, 7])))
    pool.run_copies(kv, batch)
    pool.load(kv, torch.tensor([30, 1, 7]), torch.tensor([12, 13, 14]))
    for (k0, v0), k, v in zip(before, kv.k, kv.v):
        assert torch.equal(k[[12, 13, 14]], k0) and torch.equal(v[[12, 13, 14]], v0)
    assert host_pool_tokens(1000, 512, 2.0, 0, 4) == 2000
    assert host_pool_tokens(1000, 500, 2.0, 1e-3, 64) == 2000 - 2000 % 64  # 1 MB
    assert HostKVPool.try_create(0, 1, 1, 1, 1, torch.float32, torch.device("cpu")) is None


# ---------------------------------------------------------------------------- the engine
chat = multi_turn_chats


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_path):
    from radixray.cluster.engine import Engine

    with Engine(tiny_llama_path, max_total_tokens=300) as engine:
        results = chat(engine)
        assert engine.scheduler.metrics()["host_cached_tokens_total"] == 0
        return [[r["output_ids"] for r in turn] for turn in results]


@pytest.mark.parametrize("args", [
    {},
    {"hicache_write_policy": "write_back"},
    {"disable_overlap_schedule": True},
    {"hicache_size": 4000 * 512 / 1e9},  # GB: 4000 tokens of the tiny model's KV
], ids=["write_through", "write_back", "no_overlap", "size_gb"])
def test_engine_outputs_match_and_history_hits_host(tiny_llama_path, plain_outputs, args):
    from radixray.cluster.engine import Engine

    with Engine(tiny_llama_path, max_total_tokens=300, enable_hierarchical_cache=True,
                debug_invariants=True, **args) as engine:
        results = chat(engine)
        assert [[r["output_ids"] for r in turn] for turn in results] == plain_outputs
        later = [r["meta_info"] for turn in results[1:] for r in turn]
        assert all(m["cached_tokens_details"]["host"] > 0 for m in later)
        assert all(m["cached_tokens_details"]["device"] + m["cached_tokens_details"]["host"]
                   == m["cached_tokens"] for m in later)
        expected = 4000 if "hicache_size" in args else 600
        assert engine.runner.host_pool_tokens == expected


def test_engine_tiny_host_pool_is_correct(tiny_llama_path, plain_outputs):
    from radixray.cluster.engine import Engine

    with Engine(tiny_llama_path, max_total_tokens=300, enable_hierarchical_cache=True,
                hicache_ratio=0.1, debug_invariants=True) as engine:
        results = chat(engine)
        assert [[r["output_ids"] for r in turn] for turn in results] == plain_outputs
        assert engine.scheduler.cache.hicache.stats.backup_failed > 0


@pytest.mark.ray
def test_tp2_workers_run_the_tier_copies(ray_session, tiny_llama_path, plain_outputs):
    """Copies ride in the broadcast ForwardBatch: every rank moves its own KV shard."""
    from radixray.cluster.worker_group import WorkerGroup
    from radixray.worker.model_runner import RunnerConfig

    group = WorkerGroup(RunnerConfig(tiny_llama_path, max_total_tokens=300,
                                     enable_hierarchical_cache=True), tp_size=2,
                        step_timeout_s=60)
    try:
        sched = Scheduler(SchedulerConfig(enable_hierarchical_cache=True,
                                          debug_invariants=True), group)
        assert sched.cache.hicache.host_allocator.size == group.host_pool_tokens == 600

        class SchedulerEngine:  # what chat() needs of an Engine
            scheduler = sched

            def generate(self, input_ids, sampling_params):
                reqs = [Req(f"{id(ids)}-{i}", ids, SamplingParams.from_dict(sampling_params))
                        for i, ids in enumerate(input_ids)]
                outs = {r.rid: [] for r in reqs}
                for r in reqs:
                    sched.add_request(r)
                while sched.has_work:
                    for o in sched.step():
                        outs[o.rid] += o.new_token_ids
                return [{"output_ids": outs[r.rid]} for r in reqs]

        results = chat(SchedulerEngine())
        assert [[r["output_ids"] for r in turn] for turn in results] == plain_outputs
        assert sched.stats.host_cached_tokens > 0
    finally:
        group.shutdown()
