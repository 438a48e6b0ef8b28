"""A batch's KV as page lists (CSR), the form FlashInfer's paged attention takes, with one
token per page: request b's pages are its slots ``req_to_token[rows[b], :seq_lens[b]]``.

Built without reading the device: the lengths come from the host, so ``indptr`` is a host
tensor (FlashInfer's ``plan`` reads it on the host anyway; a device one would be copied back,
a stream sync each step) and the indices are gathered with sizes known in advance rather than
by a boolean mask, whose size only the device knows.
"""

from __future__ import annotations

import torch

from ..worker.host_copy import to_device


def page_lists(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B + 1] int32 on the host, indices [sum(seq_lens)] int32 on rows' device,
    last_page_len [B] int32 on the host: all ones)."""
    device, batch, total = rows.device, len(seq_lens), sum(seq_lens)
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
    # entry n of the flat list: request which[n], position n - (that request's first entry)
    which = torch.repeat_interleave(torch.arange(batch, device=device),
                                    to_device(seq_lens, device), output_size=total)
    first = to_device(indptr[:-1].long(), device)
    pos = torch.arange(total, device=device) - first[which]
    indices = req_to_token[rows[which], pos].to(torch.int32)
    return indptr, indices, torch.ones(batch, dtype=torch.int32)
