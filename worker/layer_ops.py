"""The elementwise work of a decoder layer, as a pluggable strategy: RMSNorm (with the residual
add folded in), SiLU-and-multiply, rotary embedding.

In eager torch each of these is a handful of kernels (RMSNorm alone: upcast, square, mean,
rsqrt, two multiplies, downcast); a Llama layer spends ~40 launches on them against 4 matmuls.
On a GPU decode step every launch costs a few microseconds even inside a CUDA graph: on the
H200 run in bench/README.md, the likeliest share of the 3.7 ms a batch-1 step took beyond its
weight reads. ``kernels/elementwise.py`` registers ``triton``: one kernel per
op. The torch versions here are the reference the kernels are tested against, and what CPUs
run; ``pick_layer_ops`` in ``kernels`` chooses at model construction.

Numerics follow HF Llama: the residual stream is added in the model dtype, RMSNorm computes in
float32 and multiplies its weight in the model dtype, SiLU rounds to the model dtype before the
multiply, RoPE rotates in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerOps:
    """``rms_norm(x, weight, eps) -> y``: [T, H] -> [T, H], x unchanged.

    ``add_rms_norm(x, residual, weight, eps) -> (y, residual')``: residual' = x + residual,
    y = rms_norm(residual'). May overwrite ``residual`` (and return it as residual').

    ``silu_and_mul(gate_up) -> out``: [T, 2I] -> [T, I], silu(first half) * second half.

    ``rotary(q, k, cos, sin, positions) -> (q', k')``: q [T, Hq, D], k [T, Hkv, D] rotated
    (rotate-half layout) by the float32 tables cos, sin [P, D/2] at positions [T]. May
    overwrite q and k in place (they may be strided views of one fused qkv output).
    """

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rotary: Callable


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor):
    cos = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    sin = sin[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


TORCH_OPS = LayerOps("torch", rms_norm, add_rms_norm, silu_and_mul, rotary)
LAYER_OPS: dict[str, LayerOps] = {"torch": TORCH_OPS}


def register_layer_ops(ops: LayerOps) -> LayerOps:
    LAYER_OPS[ops.name] = ops
    return ops
