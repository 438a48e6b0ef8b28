"""``pack_batch`` / ``unpack_batch`` (worker/forward_batch.py) and ``BatchChannel``
(cluster/tp_worker.py): a ForwardBatch sent to tensor-parallel peers as one byte tensor must
come back equal field by field (dtype, shape, values, None-ness), and a step must cost one
collective unless the batch overflows the channel's buffer.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from fake_runner import FakeRunner
from helpers import run_ranks
from radixray.scheduler.config import SchedulerConfig
from radixray.scheduler.request import Req
from radixray.scheduler.scheduler import Scheduler
from radixray.worker.forward_batch import ForwardBatch, pack_batch, unpack_batch
from radixray.worker.sampling_params import SamplingParams


def assert_same(a, b, where="batch"):
    """Deep equality that also checks tensor dtype and shape (torch.equal alone does not)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert b.device.type == "cpu" and torch.equal(a.cpu(), b), where
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, where


def roundtrip(batch: ForwardBatch) -> ForwardBatch:
    packed = pack_batch(batch)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    out = unpack_batch(packed)
    assert_same(batch, out)
    packed.fill_(0)  # the result must not alias the buffer it came from
    assert_same(batch, out)
    return out


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def minimal(b: int = 2) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.arange(b) + 7, positions=torch.arange(b), req_pool_indices=i64(*range(b)),
        prefix_lens=torch.zeros(b, dtype=torch.int64), extend_lens=torch.ones(b, dtype=torch.int64),
        out_cache_loc=torch.arange(b) + 100, prefix_slots=torch.empty(0, dtype=torch.int64),
        prefix_slot_lens=torch.zeros(b, dtype=torch.int64),
        sampling_params=[SamplingParams() for _ in range(b)])


def test_every_optional_field_none_and_empty_tensors():
    batch = minimal()
    out = roundtrip(batch)
    for f in dataclasses.fields(ForwardBatch):
        if getattr(batch, f.name) is None:
            assert getattr(out, f.name) is None, f.name
    assert out.prefix_slots.shape == (0,) and out.prefix_slots.dtype == torch.int64
    assert out.penalty_history == []


def test_every_field_set_with_mixed_dtypes():
    b = 3
    batch = dataclasses.replace(
        minimal(b),
        sampling_params=[SamplingParams(temperature=0.7, top_k=5, stop=["x"], seed=11),
                         SamplingParams(frequency_penalty=0.5, logit_bias={3: -1.5}),
                         SamplingParams(json_schema='{"type": "object"}', stop_token_ids=[2])],
        penalty_history=[None, ([1, 2, 3], [9, 9]), ([], [])],
        output_lens=i64(0, 4, 0),
        return_logprob=torch.tensor([True, False, True]),
        top_logprobs_num=i64(2, -1, 0),
        input_logprob_starts=i64(-1, 0, 5),
        vocab_mask=torch.randint(-2**31, 2**31 - 1, (b, 5), dtype=torch.int32),
        kv_store=(i64(4, 5), i64(40, 41)),
        kv_load=(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)))
    out = roundtrip(batch)
    assert out.vocab_mask.dtype == torch.int32 and out.return_logprob.dtype == torch.bool
    assert out.sampling_params[1].logit_bias == {3: -1.5}
    assert out.is_decode_only == batch.is_decode_only


def test_fields_are_handled_by_type_not_name():
    """Anything a future field may hold: float, half, 0-d, 2-d, non-contiguous, a tensor
    nested in a dict, the same tensor twice."""
    shared = torch.tensor([1.5, -2.25], dtype=torch.float32)
    batch = minimal()
    batch.vocab_mask = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # non-contiguous
    batch.output_lens = torch.tensor(3)  # 0-d
    batch.kv_store = (shared, shared)
    batch.penalty_history = [{"a": torch.tensor([0.5], dtype=torch.float16)}, None]
    out = roundtrip(batch)
    assert out.vocab_mask.shape == (4, 3) and out.output_lens.dim() == 0
    assert out.kv_store[0] is out.kv_store[1]  # pickle's memo: shared once, shared again


def test_large_batch_roundtrips():
    b, t = 64, 20_000  # far more than a 64 KiB channel buffer
    batch = dataclasses.replace(
        minimal(b), input_ids=torch.randint(0, 50_000, (t,)), positions=torch.arange(t),
        out_cache_loc=torch.randperm(t), prefix_slots=torch.randperm(t),
        penalty_history=[(list(range(500)), [1] * 50)] * b,
        vocab_mask=torch.randint(0, 2**31 - 1, (b, 1000), dtype=torch.int32))
    packed = pack_batch(batch)
    assert packed.numel() > 400_000
    roundtrip(batch)


def test_unpack_rejects_what_pack_did_not_make():
    with pytest.raises(ValueError, match="^packed: "):
        unpack_batch(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^packed: "):
        unpack_batch(pack_batch(minimal()).to(torch.int64))
    truncated = pack_batch(minimal())[:40]
    with pytest.raises(ValueError, match="^packed: "):
        unpack_batch(truncated)


def test_scheduler_built_batches_roundtrip():
    """Real batches: prefill chunks, decode, penalties, logprobs, host-cache copy lists."""
    runner = FakeRunner(300, 16, 4096, 1, host_pool_tokens=600)
    runner.keep_batches = True
    sched = Scheduler(SchedulerConfig(enable_hierarchical_cache=True, chunked_prefill_size=64,
                                      debug_invariants=True), runner)
    rng = random.Random(0)
    history = [[rng.randrange(1000) for _ in range(40)] for _ in range(6)]
    for turn in range(4):
        for c, h in enumerate(history):
            h += [rng.randrange(1000) for _ in range(10)]
            params = SamplingParams(max_new_tokens=6, repetition_penalty=1.1 if c % 2 else 1.0)
            sched.add_request(Req(f"t{turn}-{c}", list(h), params, return_logprob=c == 1,
                                  top_logprobs_num=2 if c == 1 else 0))
        outs: dict[str, list[int]] = {}
        while sched.has_work:
            for o in sched.step():
                outs.setdefault(o.rid, []).extend(o.new_token_ids)
        for c in range(len(history)):
            history[c] += outs[f"t{turn}-{c}"]
    seen = set()
    for batch in runner.batches:
        roundtrip(batch)
        seen |= {f.name for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None}
        if any(h is not None for h in batch.penalty_history):
            seen.add("penalty history")
    assert {"kv_store", "kv_load", "return_logprob", "penalty history"} <= seen, seen


# ------------------------------------------------------------------------------ BatchChannel
def _channel_rank(rank: int, port: int, batches: list, capacity: int, queue) -> None:
    import torch.distributed as dist
    from radixray.cluster.tp_worker import BatchChannel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    calls = []
    real = dist.broadcast
    dist.broadcast = lambda t, src, group=None: (calls.append(t.numel()), real(t, src, group))[1]
    channel = BatchChannel("cpu", capacity=capacity)
    got = []
    if rank == 0:
        for b in batches:
            channel.send(b)
            got.append(len(calls))
        channel.send(None)
    else:
        while (b := channel.recv()) is not None:
            got.append((b, len(calls)))
    got.append(len(calls))
    queue.put((rank, got))
    dist.destroy_process_group()


def test_channel_one_collective_per_step_and_overflow():
    capacity = 4096
    small, big = minimal(2), dataclasses.replace(minimal(2), prefix_slots=torch.arange(2000))
    assert pack_batch(small).numel() <= capacity - 8 < pack_batch(big).numel()
    batches = [small, big, small, big, big]
    results = run_ranks(_channel_rank, batches, capacity)
    calls_per_batch = [1, 2, 1, 2, 2]
    expected_counts = [sum(calls_per_batch[:i + 1]) for i in range(len(batches))]
    assert results[0][:-1] == expected_counts
    received = results[1][:-1]
    assert [n for _, n in received] == expected_counts
    for sent, (got, _) in zip(batches, received):
        assert_same(sent, got)
    assert results[0][-1] == results[1][-1] == expected_counts[-1] + 1  # stop: one more
