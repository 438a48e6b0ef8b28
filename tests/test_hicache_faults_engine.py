"""Hierarchical-cache copy failures on the worker side: the host pool reports a copy that
raises instead of raising (worker/host_pool.py), the runner puts the outcome in its output and
agrees on it over the TP group (worker/model_runner.py), and the engine, with its host pool's
copies broken on purpose (leaving garbage where they were writing), still gives the greedy
outputs of a run without the tier. The scheduler side is in test_hicache_faults.py.
"""

from __future__ import annotations


import pytest
import torch

from helpers import multi_turn_chats, run_ranks
from radixray.worker.attention import KVCache
from radixray.worker.forward_batch import ForwardBatch
from radixray.worker.host_pool import HostKVPool, slot_runs


# ---------------------------------------------------------------------------- the worker side
def filled_kv(layers=2, slots=33):
    kv = KVCache(layers, slots, 2, 4, torch.float32, "cpu", 2, 8)
    for k, v in zip(kv.k, kv.v):
        k.normal_()
        v.normal_()
    return kv


def copy_batch(**copies) -> ForwardBatch:
    return ForwardBatch(*[torch.empty(0, dtype=torch.int64)] * 8, sampling_params=[], **copies)


def test_slot_runs():
    assert slot_runs(torch.tensor([], dtype=torch.int64)) == []
    assert slot_runs(torch.tensor([5, 6, 7, 2, 3, 9])) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]


@pytest.mark.parametrize("dma", [False, True], ids=["indexed", "dma_runs"])
def test_host_pool_round_trip(dma):
    """Both copy paths (``dma``: the CUDA path's per-run transfers, run on the CPU here)."""
    kv = filled_kv()
    pool = HostKVPool(32, 1, 2, 2, 4, torch.float32, torch.device("cpu"))
    pool.dma = dma
    src, host, dst = torch.tensor([3, 5, 6, 7, 9]), torch.tensor([30, 1, 2, 3, 7]), \
        torch.tensor([12, 13, 20, 21, 14])
    before = [(k[src].clone(), v[src].clone()) for k, v in zip(kv.k, kv.v)]
    assert pool.run_copies(kv, copy_batch(kv_store=(src, host))) == (True, True)
    assert pool.run_copies(kv, copy_batch(kv_load=(host, dst))) == (True, True)
    for (k0, v0), k, v in zip(before, kv.k, kv.v):
        assert torch.equal(k[dst], k0) and torch.equal(v[dst], v0)


def test_a_failing_store_is_reported_and_the_load_still_runs():
    kv = filled_kv()
    pool = HostKVPool(32, 1, 2, 2, 4, torch.float32, torch.device("cpu"))
    pool.run_copies(kv, copy_batch(kv_store=(torch.tensor([4]), torch.tensor([8]))))

    def broken(*args):
        raise RuntimeError("pinned memory exhausted")

    pool.store = broken
    batch = copy_batch(kv_store=(torch.tensor([1]), torch.tensor([2])),
                       kv_load=(torch.tensor([8]), torch.tensor([11])))
    assert pool.run_copies(kv, batch) == (False, True)
    assert torch.equal(kv.k[0][11], kv.k[0][4])


def test_copies_only_batch_and_outcome_cross_the_wire():
    """A batch of copies only goes through the TP broadcast format; the outcome through
    Ray's pickling of the output."""
    import pickle

    from radixray.worker.forward_batch import ForwardOutput, pack_batch, unpack_batch

    batch = copy_batch(kv_store=(torch.tensor([1, 2]), torch.tensor([7, 8])),
                       kv_load=(torch.tensor([3]), torch.tensor([4])))
    got = unpack_batch(pack_batch(batch))
    assert got.batch_size == 0 and got.num_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(got.kv_store + got.kv_load,
                                                 batch.kv_store + batch.kv_load))
    out = pickle.loads(pickle.dumps(ForwardOutput(torch.empty(0, dtype=torch.int64),
                                                  kv_store_ok=False)))
    assert out.kv_store_ok is False and out.kv_load_ok is True


def test_runner_reports_copy_outcomes_and_runs_copies_only_batches(tiny_llama_path):
    from radixray.worker.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(tiny_llama_path, max_total_tokens=64,
                                      enable_hierarchical_cache=True))
    ok = runner.forward(copy_batch(kv_store=(torch.tensor([1, 2]), torch.tensor([5, 6]))))
    assert ok.next_token_ids.numel() == 0 and ok.kv_store_ok and ok.kv_load_ok

    def broken(*args):
        raise IndexError("bad slot")

    runner.host_pool.load = broken
    out = runner.forward(copy_batch(kv_load=(torch.tensor([5, 6]), torch.tensor([9, 10]))))
    assert out.kv_store_ok and not out.kv_load_ok


def _tp_rank(rank: int, port: int, model: str, queue) -> None:
    import torch.distributed as dist

    from radixray.worker.model_runner import ModelRunner, RunnerConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    runner = ModelRunner(RunnerConfig(model, max_total_tokens=64, tp_rank=rank, tp_size=2,
                                      enable_hierarchical_cache=True))
    results = []
    for failing in (None, "store", "load"):
        if failing is not None and rank == 1:  # only the peer fails; rank 0's copies work

            def broken(*args):
                raise RuntimeError("injected")

            setattr(runner.host_pool, failing, broken)
        out = runner.forward(copy_batch(kv_store=(torch.tensor([1, 2]), torch.tensor([5, 6])),
                                        kv_load=(torch.tensor([5, 6]), torch.tensor([9, 10]))))
        results.append((out.kv_store_ok, out.kv_load_ok))
    queue.put((rank, results))
    dist.destroy_process_group()


def test_tp_a_peer_rank_failure_reaches_rank_0(tiny_llama_path):
    """Every rank copies its own KV shard; rank 0's output (the one the scheduler sees)
    reports a copy that failed on any rank (one all-reduce in batches with copies)."""
    results = run_ranks(_tp_rank, tiny_llama_path)
    expected = [(True, True), (False, True), (False, False)]
    assert results[0] == results[1] == expected


# ---------------------------------------------------------------------------- the engine
def engine_chats(engine):
    """Greedy outputs and host-hit tokens of every turn of ``multi_turn_chats``."""
    results = multi_turn_chats(engine)
    return ([[r["output_ids"] for r in res] for res in results],
            [sum(r["meta_info"]["cached_tokens_details"]["host"] for r in res)
             for res in results])


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    from radixray.cluster.engine import Engine

    with Engine(tiny_llama_path, max_total_tokens=300) as engine:
        return engine_chats(engine)[0]


def break_nth(pool, name, calls):
    """Make ``pool.<name>`` scribble garbage where it would write and raise on the listed
    call numbers (all calls when ``calls`` is None); returns the call counter."""
    real, count = getattr(pool, name), [0]

    def copy(kv, src, dst):
        count[0] += 1
        if calls is None or count[0] in calls:
            if name == "store":
                pool.data[dst] = torch.randn_like(pool.data[dst])
            else:
                for k, v in zip(kv.k, kv.v):
                    k[dst.to(k.device)] = torch.randn_like(k[dst.to(k.device)])
            raise RuntimeError(f"injected {name} failure")
        real(kv, src, dst)

    setattr(pool, name, copy)
    return count


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("name", ["store", "load"])
def test_engine_copy_failures_recompute(tiny_llama_path, plain, overlap, name):
    """The first copies fail (store or load): greedy outputs stay identical to a run without
    the tier, failures are counted, invariants hold every step, and host hits come back."""
    from radixray.cluster.engine import Engine

    with Engine(tiny_llama_path, max_total_tokens=300, enable_hierarchical_cache=True,
                debug_invariants=True, disable_overlap_schedule=not overlap) as engine:
        calls = break_nth(engine.runner.host_pool, name, {1, 2})
        outputs, host = engine_chats(engine)
        assert outputs == plain
        assert calls[0] > 2 and host[-1] > 0
        assert engine.scheduler.metrics()["hicache_copy_failures_total"] == 2


def test_engine_every_load_failing(tiny_llama_path, plain):
    from radixray.cluster.engine import Engine

    with Engine(tiny_llama_path, max_total_tokens=300, enable_hierarchical_cache=True,
                debug_invariants=True) as engine:
        break_nth(engine.runner.host_pool, "load", None)
        outputs, host = engine_chats(engine)
        assert outputs == plain and sum(host) == 0
        assert engine.scheduler.cache.hicache.stats.load_failures > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("broken", [None, "store", "load"])
def test_cuda_copy_stream_keeps_outputs(tmp_path, broken):
    """On a GPU the copies run on their own stream with pinned memory and per-run transfers:
    outputs equal a run without the tier, host hits happen, failures recompute. Needs no
    conftest fixture (bench/gpu_check.sh runs it with --noconftest)."""
    from radixray.cluster.engine import Engine
    from radixray.worker.make_model import make_model

    path = make_model(str(tmp_path), arch="llama", hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, intermediate_size=128, vocab_size=2048,
                      max_position=2048, seed=0)
    args = dict(device="cuda", dtype="float32", max_total_tokens=300)
    with Engine(path, **args) as engine:
        plain_outputs = engine_chats(engine)[0]
    with Engine(path, enable_hierarchical_cache=True, debug_invariants=True, **args) as engine:
        assert engine.runner.host_pool.copy_stream is not None
        if broken:
            break_nth(engine.runner.host_pool, broken, {1, 2})
        outputs, host = engine_chats(engine)
    assert outputs == plain_outputs
    assert host[-1] > 0
