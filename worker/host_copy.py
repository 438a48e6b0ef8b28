"""Host values onto the device without waiting for the device.

A blocking host-to-device copy (``tensor.to("cuda")``, ``torch.tensor(..., device="cuda")``)
synchronises the stream: the host waits for every kernel queued before it, so under overlap
scheduling the next batch is not queued until the previous forward has finished. A
non-blocking copy from pageable memory still goes through the driver's staging path, which is
not asynchronous in every case; from pinned memory it is. torch's caching host allocator
keeps a pinned buffer until the copies that read it have run, so the pinned copy may be
dropped at once.
"""

from __future__ import annotations

import torch


def to_device(host, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``host`` (a list, or a tensor on the CPU) as a tensor on ``device``: on CUDA through
    pinned memory and a non-blocking copy, elsewhere a plain conversion (no copy on the CPU)."""
    t = torch.as_tensor(host, dtype=dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
