"""CUDA graphs for decode batches: capture a ModelRunner's model + logits once per batch size,
then replay them.

A decode step of a small batch is a few hundred tiny kernel launches whose CPU cost exceeds the
GPU time; a graph replays them all with one launch. Batches are padded up to the next captured
size: padding entries use table row 0, position 0 and KV slot 0, which the allocators never hand
out, so they only overwrite the padding slot.

Per step (``forward``): copy the batch into static device buffers (one asynchronous copy from
pinned memory; future token references resolve inside the graph, so the running step is not
waited for), write the new tokens' slots into the request-to-token table, ``attn.prepare``
outside the graph (backends with ``supports_cuda_graph`` update buffers the graph reads, in
place), replay, then sample from the graph's logits outside it. Optional: nothing imports this module unless a
runner asks for graphs, and it needs a CUDA device.
"""

from __future__ import annotations

import torch

from ..worker.attention import AttentionMetadata
from ..worker.forward_batch import ForwardBatch, ForwardOutput

CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraphRunner:
    """Graph replays of ``runner.model`` for decode-only batches of ``runner.attn``'s backend.

    Capturing mutates the KV padding slot 0, table row 0 and the backend's buffers; it
    allocates a private memory pool shared by all captured sizes.
    """

    def __init__(self, runner, batch_sizes=CUDA_GRAPH_BATCH_SIZES):
        if runner.device.type != "cuda":
            raise ValueError("cuda_graph: needs a CUDA device")
        if not getattr(runner.attn, "supports_cuda_graph", False):
            raise ValueError(f"cuda_graph: attention backend {type(runner.attn).__name__} does "
                             "not support CUDA graphs")
        self.runner, self.attn = runner, runner.attn
        self.sizes = sorted(s for s in set(batch_sizes) if 1 <= s <= runner.max_running_requests)
        if not self.sizes:
            raise ValueError(f"cuda_graph: no batch size in {batch_sizes} fits "
                             f"max_running_requests={runner.max_running_requests}")
        max_bs, dev = self.sizes[-1], runner.device
        # rows: input ids, positions, table rows, prefix lens, out slots; one H2D copy per step
        self.static = torch.zeros((5, max_bs), dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.rows, self.prefix_lens, self.out_loc = self.static
        self.host = torch.zeros((5, max_bs), dtype=torch.int64, pin_memory=True)
        self.copied = torch.cuda.Event()  # recorded after each step's copy from self.host
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                self._capture(bs)

    def can_run(self, batch: ForwardBatch) -> bool:
        starts = batch.input_logprob_starts
        return (self.runner.attn is self.attn and batch.batch_size <= self.sizes[-1]
                and batch.is_decode_only
                and (starts is None or not bool((starts >= 0).any())))

    def _meta(self, bs: int, prefix_lens_cpu: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            req_rows=self.rows[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs], out_cache_loc=self.out_loc[:bs],
            prefix_lens_cpu=prefix_lens_cpu, extend_lens_cpu=[1] * bs, decode_only=True)

    def _step(self, bs: int) -> torch.Tensor:
        model = self.runner.model
        # overlap scheduling's future references (-row) resolve inside the graph: the
        # runner's future-token buffer is as static as the input buffers
        input_ids = self.runner.resolve_on_device(self.input_ids[:bs])
        hidden = model(input_ids, self.positions[:bs], self.attn)
        return model.logits(hidden)

    def _capture(self, bs: int) -> None:
        self.static.zero_()
        meta = self._meta(bs, [0] * bs)
        for _ in range(2):  # eager warm-up: compiles kernels, lets backends learn shapes
            self.attn.prepare(meta, self.runner.kv)
            self._step(bs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        self.attn.prepare(meta, self.runner.kv)
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[bs] = self._step(bs)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """One decode step (``can_run(batch)`` must hold), as ``ModelRunner.forward``. Mutates
        the static buffers, the request-to-token table, the KV buffers at the batch's slots,
        the backend's buffers and the runner's future-token buffer."""
        bs = batch.batch_size
        padded = next(s for s in self.sizes if s >= bs)
        self.runner.check_future_refs(batch.input_ids)
        self.copied.synchronize()  # the last step's copy has read the pinned buffer
        host = self.host[:, :padded]
        host[:, bs:] = 0
        host[0, :bs] = batch.input_ids  # future references resolve in the graph
        host[1, :bs] = batch.positions
        host[2, :bs] = batch.req_pool_indices
        host[3, :bs] = batch.prefix_lens
        host[4, :bs] = batch.out_cache_loc
        # Pinned memory and an asynchronous copy: this method waits only for the previous
        # copy out of the buffer, never for the step still running, so under overlap
        # scheduling the step is queued behind it.
        self.static[:, :padded].copy_(host, non_blocking=True)
        self.copied.record()
        # the new token's slot goes into the table before prepare: backends read the table
        self.runner.kv.req_to_token[self.rows[:padded], self.prefix_lens[:padded]] = \
            self.out_loc[:padded]
        prefix_cpu = batch.prefix_lens.tolist() + [0] * (padded - bs)
        self.attn.prepare(self._meta(padded, prefix_cpu), self.runner.kv)
        self.graphs[padded].replay()
        out = self.runner.sampler(self.logits[padded][:bs], batch)
        # as ModelRunner.forward: later batches may refer to these tokens (overlap scheduling)
        self.runner.mark_sampled(batch.req_pool_indices, out.next_token_ids, self.rows[:bs])
        return out
