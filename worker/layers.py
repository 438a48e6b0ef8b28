"""Building blocks of a decoder layer, tensor-parallel ready.

Each parallel layer owns the local shard of its weight and attaches a ``weight_loader`` to every
parameter: given the *full* checkpoint tensor (and, for merged layers, which part it is), it
copies this rank's slice in. The slicing itself is ``TensorParallel``'s. At tp=1 every layer is
a plain ``nn.Linear``/``nn.Embedding`` in disguise.

Shapes: T = tokens in the batch, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layer_ops import TORCH_OPS, LayerOps
from .model_config import RopeScaling
from .parallel import TensorParallel


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader
    return param


def _check_shape(name: str, expected: tuple, got: tuple) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"{name}: checkpoint shape {tuple(got)} does not match expected "
                         f"{tuple(expected)}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split across ranks; the output stays sharded.

    ``part_sizes`` lists the full output sizes of merged parts (q, k, v or gate, up); each part
    is split on its own, so a rank holds [q_shard | k_shard | v_shard]. ``part_ranges`` may give
    (start, length) per part explicitly (KV heads replicated across ranks).
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, tp: TensorParallel,
                 part_ranges: list[tuple[int, int]] | None = None):
        super().__init__()
        self.part_sizes = part_sizes
        self.part_ranges = part_ranges or [tp.split(s, "output size") for s in part_sizes]
        self.local_sizes = [length for _, length in self.part_ranges]
        out_local = sum(self.local_sizes)
        self.weight = _set_loader(nn.Parameter(torch.empty(out_local, in_features)),
                                  self._load)
        self.bias = (_set_loader(nn.Parameter(torch.empty(out_local)), self._load)
                     if bias else None)
        for param in (self.weight, self.bias):
            if param is not None:
                param.num_parts = len(part_sizes)  # the loader checks every part arrived
        self.tp = tp

    def _load(self, param: nn.Parameter, full: torch.Tensor, part: int = 0) -> None:
        start, length = self.part_ranges[part]
        _check_shape(f"part {part}", (self.part_sizes[part],) + tuple(param.shape[1:]),
                     full.shape)
        offset = sum(self.local_sizes[:part])
        param.data[offset : offset + length].copy_(self.tp.shard(full, 0, start, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's input columns split across ranks; partial sums are all-reduced,
    then the (unsplit) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.in_range = tp.split(in_features, "input size")
        self.out_features = out_features
        self.weight = _set_loader(nn.Parameter(torch.empty(out_features, self.in_range[1])),
                                  self._load_weight)
        self.bias = (_set_loader(nn.Parameter(torch.empty(out_features)), self._load_bias)
                     if bias else None)
        self.tp = tp

    def _load_weight(self, param: nn.Parameter, full: torch.Tensor, part: int = 0) -> None:
        _check_shape("weight", (self.out_features, self.in_range[1] * self.tp.size), full.shape)
        param.data.copy_(self.tp.shard(full, 1, *self.in_range))

    def _load_bias(self, param: nn.Parameter, full: torch.Tensor, part: int = 0) -> None:
        _check_shape("bias", param.shape, full.shape)
        param.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table with vocabulary rows split across ranks (the vocabulary padded to a
    multiple of the tp size; padding rows are zero). Ids outside this rank's range give zeros
    locally; the all-reduce fills them in from the owning rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_local, self.vocab_real = tp.vocab_split(vocab_size)
        self.weight = _set_loader(nn.Parameter(torch.zeros(self.vocab_local, hidden_size)),
                                  self._load)
        self.tp = tp

    def _load(self, param: nn.Parameter, full: torch.Tensor, part: int = 0) -> None:
        _check_shape("weight", (self.vocab_size, param.shape[1]), full.shape)
        param.data.zero_()
        param.data[:self.vocab_real].copy_(
            self.tp.shard(full, 0, self.vocab_start, self.vocab_real))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; full logits are gathered on every rank
    (rank 0 samples from them)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        logits = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))
        # padding columns (a vocabulary not divisible by the tp size) are no tokens
        return logits if logits.shape[-1] == self.vocab_size else \
            logits[..., :self.vocab_size].contiguous()


class RMSNorm(nn.Module):
    """``norm(x)`` -> y; ``norm(x, residual)`` -> (y, x + residual): the residual add folded
    into the norm, so a fused kernel does both in one pass (see layer_ops.py)."""

    def __init__(self, hidden_size: int, eps: float, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.weight = _set_loader(nn.Parameter(torch.ones(hidden_size)), _copy_full)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def _copy_full(param: nn.Parameter, full: torch.Tensor, part: int = 0) -> None:
    _check_shape("weight", param.shape, full.shape)
    param.data.copy_(full)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3's long-context rescaling when configured:
    wavelengths longer than original_len / low_freq_factor are slowed by ``factor``, shorter
    than original_len / high_freq_factor kept, and the band between interpolated smoothly."""
    # float32 throughout, as HF computes it, so positions rotate bit-for-bit alike
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type != "llama3":
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, interpolated, out).float()


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout, as HF Llama/Qwen2) to q and k at given positions."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling,
                 ops: LayerOps = TORCH_OPS):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.ops = ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, heads, D], k: [T, kv_heads, D]; may rotate them in place
        return self.ops.rotary(q, k, self.cos, self.sin, positions)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up merged into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
