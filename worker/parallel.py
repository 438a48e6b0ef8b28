"""Tensor-parallel context: the one place that knows how tensors are split across ranks.

Every parallel layer asks ``TensorParallel`` which slice of a full weight it owns and calls its
collectives. At ``size == 1`` every collective is the identity and no ``torch.distributed``
group is needed, so single-process tests and the offline Engine never touch it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    # --- shard arithmetic -------------------------------------------------------------------
    def split(self, total: int, what: str = "dimension") -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total``; uneven splits are an error."""
        if total % self.size:
            raise ValueError(f"{what} {total} is not divisible by tp size {self.size}")
        length = total // self.size
        return self.rank * length, length

    def vocab_split(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, rows, real rows) of this rank's share of a vocabulary padded to a multiple of
        the tp size (as SGLang pads it: a fine-tune's 32,001 tokens still split): every rank
        holds ``rows`` rows, the first ``real rows`` of them real, the rest zero padding."""
        rows = -(-vocab_size // self.size)
        start = self.rank * rows
        return start, rows, max(min(rows, vocab_size - start), 0)

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """KV heads of this rank. With fewer KV heads than ranks, heads are replicated: rank r
        uses head ``r * num_kv_heads // size``."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tp size {self.size} is not a multiple of num_key_value_heads "
                             f"{num_kv_heads}")
        return self.rank * num_kv_heads // self.size, 1

    def shard(self, full: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
        return full.narrow(dim, start, length)

    # --- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (e.g. vocab-sharded logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
