"""HostKVPool: this rank's host-memory tier of the KV cache (the hierarchical cache's L2).

The scheduler decides which host slot holds which prefix (``scheduler/hicache.py``); this pool
only holds the data and runs the copies a ``ForwardBatch`` carries. Layout: one tensor
``[num_slots, num_layers, 2 (K, V), kv_heads_local, head_dim]``, so one token's KV over all
layers is one contiguous row: a copy in either direction is one gather, one transfer and one
scatter per layer, for the whole batch's token list, never per token. On CUDA the tensor is in
pinned memory, which makes the host side of the transfers DMA-able.

Copies run on the forward's thread (the worker's own thread under overlap scheduling), so
the scheduler builds the next batch while they run.
"""

from __future__ import annotations

import logging

import torch

from .attention import KVCache
from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def host_pool_tokens(device_tokens: int, bytes_per_token: int, ratio: float,
                     size_gb: float, page_size: int = 1) -> int:
    """Host pool size in tokens: ``size_gb`` GB of this rank's KV when > 0, else ``ratio``
    times the device pool; rounded down to whole pages."""
    tokens = int(size_gb * 2**30 // bytes_per_token) if size_gb > 0 else int(ratio * device_tokens)
    return tokens - tokens % page_size


class HostKVPool:
    def __init__(self, num_tokens: int, page_size: int, num_layers: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        """Slots ``0 .. num_tokens`` (slot 0 unused, as on the device), in whole pages."""
        num_slots = (num_tokens // page_size + 1) * page_size
        self.num_tokens = num_tokens
        self.device = torch.device(device)
        self.data = torch.zeros((num_slots, num_layers, 2, kv_heads, head_dim), dtype=dtype,
                                pin_memory=self.device.type == "cuda")

    @classmethod
    def try_create(cls, num_tokens: int, *args) -> "HostKVPool | None":
        """The pool, or None (logged) when host memory cannot hold it: the engine then runs
        without the host tier instead of failing to start."""
        if num_tokens <= 0:
            return None
        try:
            return cls(num_tokens, *args)
        except (RuntimeError, MemoryError) as e:
            log.warning("hierarchical cache off: cannot allocate a host pool of %d tokens (%s)",
                        num_tokens, e)
            return None

    def store(self, kv: KVCache, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy device slots' K/V of every layer into host slots. Mutates ``self.data``."""
        idx = device_slots.to(self.device)
        staged = torch.stack([torch.stack((k[idx], v[idx]), 1) for k, v in zip(kv.k, kv.v)], 1)
        self.data[host_slots] = staged.cpu()

    def load(self, kv: KVCache, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host slots' K/V of every layer into device slots. Mutates ``kv``'s buffers."""
        staged = self.data[host_slots].to(self.device, non_blocking=True)
        idx = device_slots.to(self.device)
        for layer, (k, v) in enumerate(zip(kv.k, kv.v)):
            k[idx] = staged[:, layer, 0]
            v[idx] = staged[:, layer, 1]

    def run_copies(self, kv: KVCache, batch: ForwardBatch) -> None:
        """The batch's tier copies, before its forward: stores first (the batch may reuse the
        device slots they read), then loads (they may read host slots the stores filled)."""
        if batch.kv_store is not None:
            self.store(kv, *batch.kv_store)
        if batch.kv_load is not None:
            self.load(kv, *batch.kv_load)
