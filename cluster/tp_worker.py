"""One tensor-parallel rank as a Ray actor: its shard of the model, its KV buffers.

Rank 0 is the only rank the scheduler talks to. Each ``forward`` call broadcasts the batch
description to the peers (one pickled object per step over the TP group: gloo on CPU, NCCL on
GPU), runs its own shard, and returns the sampled tokens. Peers sit in ``follow``: receive,
forward, repeat, until a ``None`` batch tells them to stop.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..worker.forward_batch import ForwardBatch, ForwardOutput
from ..worker.model_runner import ModelRunner, RunnerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorker:
    """Plain class; ``cluster.replica`` wraps it with ``ray.remote`` and a placement bundle."""

    def __init__(self, rank: int, tp_size: int, runner_cfg: RunnerConfig):
        self.rank, self.tp_size = rank, tp_size
        self.runner_cfg = runner_cfg
        self.runner: ModelRunner | None = None
        self._turn, self._next_seq = threading.Condition(), 0  # see forward
        threads = os.environ.get("RADIXRAY_TORCH_THREADS")
        if threads:
            torch.set_num_threads(int(threads))

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pick_port(self) -> int:
        return free_port()

    def init(self, master_addr: str, master_port: int, timeout_s: float = 60.0) -> dict:
        """Join the TP group (when tp > 1) and load this rank's shard. Returns pool figures."""
        cfg = self.runner_cfg
        if self.runner_cfg.device == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
        if self.tp_size > 1:
            backend = "nccl" if cfg.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.tp_size,
                                    timeout=timedelta(seconds=timeout_s))
        self.runner = ModelRunner(cfg)
        mc = self.runner.model_config
        return {"max_total_tokens": self.runner.max_total_tokens,
                "max_running_requests": self.runner.max_running_requests,
                "max_context_len": self.runner.max_context_len,
                "host_pool_tokens": self.runner.host_pool_tokens,
                "vocab_size": mc.vocab_size, "eos_token_ids": list(mc.eos_token_ids)}

    def forward(self, batch: ForwardBatch, seq: int) -> ForwardOutput:
        """Rank 0 only: share batch number ``seq`` with the peers, then run it.

        The actor is threaded (control calls must get through while a peer sits in ``follow``),
        and Ray does not keep a threaded actor's calls in order; under overlap scheduling two
        batches are in flight and the second reads the first's sampled tokens, so each call
        waits for its turn."""
        with self._turn:
            self._turn.wait_for(lambda: self._next_seq == seq)
        try:
            if self.tp_size > 1:
                dist.broadcast_object_list([batch], src=0)
            return self.runner.forward(batch)
        finally:
            with self._turn:
                self._next_seq += 1
                self._turn.notify_all()

    def follow(self) -> int:
        """Peers only: run every broadcast batch until told to stop. Returns steps run."""
        steps = 0
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return steps
            self.runner.forward(box[0])
            steps += 1

    def stop(self) -> None:
        """Rank 0: release the peers from ``follow``; every rank: leave the group."""
        if self.tp_size > 1 and dist.is_initialized():
            if self.rank == 0:
                dist.broadcast_object_list([None], src=0)

    def pid(self) -> int:
        return os.getpid()
