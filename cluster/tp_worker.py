"""One tensor-parallel rank as a Ray actor: its shard of the model, its KV buffers.

Rank 0 is the only rank the scheduler talks to. Each ``forward`` call broadcasts the batch
description to the peers (``BatchChannel``: the batch packed into one byte tensor, one
collective per step over the TP group: gloo on CPU, NCCL on GPU), runs its own shard, and
returns the sampled tokens. Peers sit in ``follow``: receive, forward, repeat, until a stop
message (length 0) tells them to stop.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..worker.forward_batch import ForwardBatch, ForwardOutput, pack_batch, unpack_batch
from ..worker.host_copy import to_device
from ..worker.model_runner import ModelRunner, RunnerConfig

CHANNEL_TIMEOUT = timedelta(days=30)  # how long a peer may wait for the next batch


def is_gpu_device(device: str) -> bool:
    """"cuda" or "cuda:N": the ranks need a GPU each. (Under Ray a rank sees only the GPU Ray
    gave it, as cuda:0, so the index of "cuda:N" cannot pick a GPU there.)"""
    return str(device).split(":", 1)[0] == "cuda"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BatchChannel:
    """Rank 0 -> peers broadcast of packed batches over the default process group.

    Every rank holds the same fixed ``capacity``-byte buffer on the group's device. A message is
    one broadcast of that buffer: bytes 0..8 hold the payload length (0 means stop), the rest
    the payload's start. Only a payload longer than ``capacity - 8`` needs a second broadcast,
    of exactly the remaining bytes; every rank knows that length from the first, so all ranks
    issue the same collectives. (A size-then-bytes protocol costs two collectives every step.)
    """

    HEADER = 8

    def __init__(self, device: str | torch.device = "cpu", capacity: int = 64 * 1024,
                 group=None):
        if capacity <= self.HEADER:
            raise ValueError(f"capacity: must exceed {self.HEADER} bytes, got {capacity}")
        self.capacity, self.device, self.group = capacity, torch.device(device), group
        self.buf = torch.zeros(capacity, dtype=torch.uint8, device=self.device)

    def send(self, batch: ForwardBatch | None) -> None:
        """Rank 0: broadcast ``batch`` (None: the stop message). Overwrites the buffer."""
        payload = pack_batch(batch) if batch is not None else torch.empty(0, dtype=torch.uint8)
        n = payload.numel()
        head = min(n, self.capacity - self.HEADER)
        # to_device never waits for the GPU: a blocking copy would hold the broadcast until
        # this rank's queued forward has finished
        message = torch.cat([torch.tensor([n], dtype=torch.int64).view(torch.uint8),
                             payload[:head]])
        self.buf[:message.numel()].copy_(to_device(message, self.device))
        dist.broadcast(self.buf, src=0, group=self.group)
        if n > head:
            dist.broadcast(to_device(payload[head:], self.device), src=0, group=self.group)

    def recv(self) -> ForwardBatch | None:
        """Peers: wait for rank 0's next message; None for the stop message."""
        dist.broadcast(self.buf, src=0, group=self.group)
        n = int(self.buf[:self.HEADER].view(torch.int64).item())
        if n == 0:
            return None
        head = min(n, self.capacity - self.HEADER)
        payload = self.buf[self.HEADER:self.HEADER + head]
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8, device=self.device)
            dist.broadcast(rest, src=0, group=self.group)
            payload = torch.cat([payload, rest])
        return unpack_batch(payload)  # copies: the buffer is reused by the next recv


class TPWorker:
    """Plain class; ``cluster.replica`` wraps it with ``ray.remote`` and a placement bundle."""

    def __init__(self, rank: int, tp_size: int, runner_cfg: RunnerConfig):
        self.rank, self.tp_size = rank, tp_size
        self.runner_cfg = runner_cfg
        self.runner: ModelRunner | None = None
        self.channel: BatchChannel | None = None  # tp > 1: the batch broadcast
        self._turn, self._next_seq = threading.Condition(), 0  # see forward
        self._stopped = threading.Event()  # ends ``watch``
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
        on_gpu = is_gpu_device(cfg.device)
        if on_gpu and torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
        if self.tp_size > 1:
            backend = "nccl" if on_gpu else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.tp_size,
                                    timeout=timedelta(seconds=timeout_s))
            # Peers wait in the channel's broadcast for as long as the replica is idle; under
            # the group's timeout an idle minute would kill them. A hung step is caught by the
            # step timeout on rank 0 instead.
            idle_group = dist.new_group(list(range(self.tp_size)), backend=backend,
                                        timeout=CHANNEL_TIMEOUT)
            self.channel = BatchChannel("cuda" if backend == "nccl" else "cpu",
                                        group=idle_group)
        self.runner = ModelRunner(cfg)
        mc = self.runner.model_config
        return {"max_total_tokens": self.runner.max_total_tokens,
                "max_running_requests": self.runner.max_running_requests,
                "max_context_len": self.runner.max_context_len,
                "host_pool_tokens": self.runner.host_pool_tokens,
                "vocab_size": mc.vocab_size, "eos_token_ids": list(self.runner.eos_token_ids)}

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
                self.channel.send(batch)
            finish = self.runner.forward(batch).start_host_copy()
        finally:
            with self._turn:
                self._next_seq += 1
                self._turn.notify_all()
        # The turn is passed on before this step's tokens are waited for: on a GPU the next
        # batch is queued behind this one instead of after its round trip through Ray.
        return finish()

    def follow(self) -> int:
        """Peers only: run every broadcast batch until told to stop. Returns steps run."""
        steps = 0
        while True:
            batch = self.channel.recv()
            if batch is None:
                return steps
            self.runner.forward(batch)
            steps += 1

    def watch(self) -> None:
        """Rank 0: returns only at ``stop``, so a pending call is a liveness probe (peers have
        ``follow`` for that): it fails when the process dies, even between batches."""
        self._stopped.wait()

    def stop(self) -> None:
        """Rank 0: release the peers from ``follow``; every rank: leave the group."""
        self._stopped.set()
        if self.tp_size > 1 and dist.is_initialized() and self.rank == 0:
            self.channel.send(None)

    def pid(self) -> int:
        return os.getpid()
