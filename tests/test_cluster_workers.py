"""Tensor-parallel worker actors under Ray: tp=2 equals tp=1 and HF; a dead rank is reported."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hf_reference import hf_greedy
from radixray.worker.model_runner import ModelRunner, RunnerConfig
from test_model_runner import Driver, Req

pytestmark = pytest.mark.ray


@pytest.fixture
def group_driver(ray_session, tiny_qwen2_path):
    from radixray.cluster.worker_group import WorkerGroup

    cfg = RunnerConfig(tiny_qwen2_path, max_total_tokens=512, max_running_requests=8)
    group = WorkerGroup(cfg, tp_size=2, step_timeout_s=30)
    # The Driver's bookkeeping needs pool figures only; the group runs the batches.
    driver = Driver(ModelRunner(cfg))
    driver.runner = group
    yield group, driver
    group.shutdown()


def _decode(driver, reqs, steps):
    for _ in range(steps):
        for r in reqs:
            r.ids.append(r.out[-1])
        driver.step([(r, len(r.ids) - 1, None) for r in reqs])


def test_tp2_equals_hf_and_detects_dead_peer(group_driver, tiny_qwen2_path):
    group, driver = group_driver
    prompts = [[5, 6, 7, 8, 9, 10], [100, 200, 300], list(range(40, 75))]
    reqs = [Req(p) for p in prompts]
    driver.step([(r, 0, None) for r in reqs])
    _decode(driver, reqs, 7)
    for r, p in zip(reqs, prompts):
        assert r.out == hf_greedy(tiny_qwen2_path, p, 8)

    # a killed peer is noticed by the next step (or by the peer check) within seconds; a
    # SIGTERM (SIGKILL always was) used to leave it half-dead: no calls taken, never noticed
    os.kill(group.pids()[1], signal.SIGTERM)
    from radixray.cluster.worker_group import WorkerGroupError

    start = time.monotonic()
    with pytest.raises(WorkerGroupError):
        for _ in range(50):
            group.check_peers()
            _decode(driver, reqs, 1)
            time.sleep(0.1)
    assert time.monotonic() - start < 15


def test_a_vocabulary_not_divisible_by_tp_is_padded(ray_session, tmp_path):
    """SGLang pads the vocabulary across ranks; radixray refused 2051 tokens at tp 2 (a
    fine-tune with one added token could not be served with tensor parallelism)."""
    from conftest import TINY
    from radixray.cluster.worker_group import WorkerGroup
    from radixray.worker.make_model import make_model

    path = make_model(str(tmp_path / "odd-vocab"), arch="llama", **{**TINY, "vocab_size": 2051})
    cfg = RunnerConfig(path, max_total_tokens=256, max_running_requests=4)
    group = WorkerGroup(cfg, tp_size=2, step_timeout_s=30)
    try:
        driver = Driver(ModelRunner(cfg))
        driver.runner = group
        prompts = [[5, 6, 7, 2050], [2049, 11, 12]]  # ids in the last rank's real rows
        reqs = [Req(p) for p in prompts]
        driver.step([(r, 0, None) for r in reqs])
        _decode(driver, reqs, 5)
        for r, p in zip(reqs, prompts):
            assert r.out == hf_greedy(path, p, 6)
    finally:
        group.shutdown()


def test_a_replica_waits_for_room_as_long_as_it_is_told(ray_session, monkeypatch, caplog):
    """No node has a GPU: the reservation says every interval that it is still waiting, gives
    up at --placement-timeout naming the flag, and leaves no placement group behind. (It was a
    fixed 300 s, shorter than a cloud GPU node takes to join.)"""
    import ray

    from radixray.cluster import replica

    monkeypatch.setattr(replica, "PLACEMENT_PROGRESS_S", 0.4)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="within 2s .*--placement-timeout"):
        replica.reserve_replica_ranks("waits", {"device": "cuda"}, tp_size=1, timeout_s=1.5,
                                      namespace="elsewhere")
    assert time.monotonic() - started >= 1.5
    assert "waiting for a node with room for 1 rank(s) on cuda" in caplog.text
    ours = [pg["state"] for pg in ray.util.placement_group_table().values()
            if pg["name"] == replica.pg_name("elsewhere", "waits")]
    assert ours == ["REMOVED"]
