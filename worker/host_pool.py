"""HostKVPool: this rank's host-memory tier of the KV cache (the hierarchical cache's L2).

The scheduler decides which host slot holds which prefix (``scheduler/hicache.py``); this pool
only holds the data and runs the copies a ``ForwardBatch`` carries. Layout: one tensor
``[num_slots, num_layers, 2 (K, V), kv_heads_local, head_dim]``, so one token's KV over all
layers is one contiguous row: a copy in either direction is one gather on the device, the
transfer, and one scatter per layer, for the whole batch's token list, never per token.

Failures: a store or a load that raises is logged and reported (``run_copies`` returns
``(stores_ok, loads_ok)``, which the runner puts in the ``ForwardOutput``), never raised: the
forward still runs (it reads no slot a copy writes: the scheduler admits a loading request
only once its load is confirmed), and the scheduler drops what the copy would have made
usable and recomputes it.

On CUDA the pool is pinned memory and the copies run on a dedicated copy stream, issued from
the forward's thread without waiting for them: the stream first waits for the compute stream
(stores read slots earlier forwards wrote; loads overwrite slots earlier forwards may still
read), the transfers are asynchronous DMA (one per run of consecutive host slots, since the
host side of an indexed copy would need the CPU), and the forward waits on an event recorded
after them. A copy issued without an error counts as done (its outcome goes back with the
output, possibly before the DMA finishes): whatever reads its result later is ordered after
it, forwards by the event and later copies by the stream. On the CPU they run in line.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from .attention import KVCache
from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)


HOST_MEMORY_SHARE = 0.8  # of the memory available at start-up, at most, for a host pool


def available_host_bytes(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Memory a new allocation of this process can take: the kernel's MemAvailable, or less
    where a memory cgroup (a container's limit: Kubernetes, Docker) leaves less. None where
    neither can be read."""
    figures = [_meminfo_available(), _cgroup_available(cgroup_root)]
    known = [b for b in figures if b is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# (folder, limit file, usage file, the memory.stat key of reclaimable page cache): v2, v1
_CGROUP_FILES = (("", "memory.max", "memory.current", "inactive_file"),
                 ("memory/", "memory.limit_in_bytes", "memory.usage_in_bytes",
                  "total_inactive_file"))
_NO_LIMIT = 1 << 60  # v1 reports "no limit" as a page-rounded 2**63 - 1


def _cgroup_available(root: str) -> int | None:
    """The cgroup's limit less its working set (usage less the inactive page cache, which the
    kernel reclaims before it OOM-kills: what kubelet counts), or None without a limit."""
    for folder, limit_file, usage_file, cache_key in _CGROUP_FILES:
        base = f"{root}/{folder}"
        try:
            with open(base + limit_file) as f:
                limit = f.read().strip()
            if limit == "max" or int(limit) >= _NO_LIMIT:
                return None
            with open(base + usage_file) as f:
                usage = int(f.read())
            cache = 0
            with open(base + "memory.stat") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == cache_key:
                        cache = int(value)
            return max(0, int(limit) - max(0, usage - cache))
        except (OSError, ValueError):
            continue
    return None


def host_pool_tokens(device_tokens: int, bytes_per_token: int, ratio: float,
                     size_gb: float, page_size: int = 1) -> int:
    """Host pool size in tokens: ``size_gb`` GB (10**9 bytes, as SGLang) of this rank's KV when
    > 0, else ``ratio`` times the device pool; rounded down to whole pages."""
    tokens = int(size_gb * 1e9 // bytes_per_token) if size_gb > 0 else int(ratio * device_tokens)
    return tokens - tokens % page_size


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slot numbers in ``slots`` (a CPU tensor), in order, as
    ``(offset in slots, first slot, length)``: each run is one contiguous range of the pool."""
    n = len(slots)
    if n == 0:
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, n]
    return [(s, first, e - s) for s, e, first in zip(starts, ends, slots[starts].tolist())]


class HostKVPool:
    def __init__(self, num_tokens: int, page_size: int, num_layers: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        """Slots ``0 .. num_tokens`` (slot 0 unused, as on the device), in whole pages."""
        num_slots = (num_tokens // page_size + 1) * page_size
        self.num_tokens = num_tokens
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.data = torch.zeros((num_slots, num_layers, 2, kv_heads, head_dim), dtype=dtype,
                                pin_memory=cuda)
        # DMA transfers per run of host slots (asynchronous from pinned memory); the CPU path
        # indexes the pool directly. Tests flip ``dma`` to run the CUDA path's indexing on CPU.
        self.dma = cuda
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.copies_done = torch.cuda.Event() if cuda else None

    @classmethod
    def try_create(cls, num_tokens: int, *args, ranks_on_host: int = 1) -> "HostKVPool | None":
        """The pool, or None (logged) when host memory cannot hold it: the engine then runs
        without the host tier instead of failing to start. ``ranks_on_host`` of the replica
        allocate their pools at the same time from the same memory: each gets its share."""
        if num_tokens <= 0:
            log.warning("hierarchical cache off: --hicache-ratio/--hicache-size give a host "
                        "pool of %d tokens", num_tokens)
            return None
        page_size, num_layers, kv_heads, head_dim, dtype = args[:5]
        need = (num_tokens + page_size) * num_layers * 2 * kv_heads * head_dim * dtype.itemsize
        free = available_host_bytes()
        if free is not None and need > HOST_MEMORY_SHARE * free / ranks_on_host:
            # zeroing a pool near the machine's free memory swaps or gets the process killed
            # instead of failing the allocation
            log.warning("hierarchical cache off: a host pool of %d tokens needs %.2f GB, more "
                        "than %d%% of the %.2f GB available%s", num_tokens, need / 1e9,
                        HOST_MEMORY_SHARE * 100, free / 1e9,
                        f", shared by {ranks_on_host} ranks" if ranks_on_host > 1 else "")
            return None
        try:
            return cls(num_tokens, *args)
        except (RuntimeError, MemoryError) as e:
            log.warning("hierarchical cache off: cannot allocate a host pool of %d tokens (%s)",
                        num_tokens, e)
            return None

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` on the device; on CUDA through pinned memory, so the thread does not wait
        for the copy stream (a pageable copy would, and that stream waits for the forward)."""
        if self.device.type != "cuda":
            return slots.to(self.device)
        return slots.pin_memory().to(self.device, non_blocking=True)

    def store(self, kv: KVCache, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy device slots' K/V of every layer into host slots. Mutates ``self.data``."""
        idx = self._index(device_slots)
        staged = torch.stack([torch.stack((k[idx], v[idx]), 1) for k, v in zip(kv.k, kv.v)], 1)
        if not self.dma:
            self.data[host_slots] = staged.cpu()
            return
        for offset, first, n in slot_runs(host_slots):
            self.data[first : first + n].copy_(staged[offset : offset + n], non_blocking=True)

    def load(self, kv: KVCache, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host slots' K/V of every layer into device slots. Mutates ``kv``'s buffers."""
        if not self.dma:
            staged = self.data[host_slots].to(self.device)
        else:
            staged = torch.empty((len(host_slots), *self.data.shape[1:]), dtype=self.data.dtype,
                                 device=self.device)
            for offset, first, n in slot_runs(host_slots):
                staged[offset : offset + n].copy_(self.data[first : first + n],
                                                  non_blocking=True)
        idx = self._index(device_slots)
        for layer, (k, v) in enumerate(zip(kv.k, kv.v)):
            k[idx] = staged[:, layer, 0]
            v[idx] = staged[:, layer, 1]

    def run_copies(self, kv: KVCache, batch: ForwardBatch) -> tuple[bool, bool]:
        """The batch's tier copies, before its forward: stores first (the batch may reuse the
        device slots they read), then loads (they may read host slots the stores filled).
        Returns ``(stores_ok, loads_ok)``: a copy that raises is logged, not raised.
        On CUDA the forward (the current stream) waits for them; this thread does not."""
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            stores_ok = batch.kv_store is None or self._attempt("store", self.store, kv,
                                                                *batch.kv_store)
            loads_ok = batch.kv_load is None or self._attempt("load", self.load, kv,
                                                              *batch.kv_load)
            if stream is not None:
                self.copies_done.record(stream)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copies_done)
        return stores_ok, loads_ok

    @staticmethod
    def _attempt(what: str, copy, kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> bool:
        try:
            copy(kv, src, dst)
            return True
        except Exception:  # the scheduler recomputes what the copy was for
            log.exception("hierarchical cache: a %s of %d tokens failed", what, len(src))
            return False
