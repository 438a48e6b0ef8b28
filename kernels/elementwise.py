"""Fused elementwise kernels of a decoder layer: the ``triton`` LayerOps of
``worker/layer_ops.py`` (whose torch functions are the references).

- ``rms_norm`` / ``add_rms_norm``: one program per token row; the residual add, the float32
  mean of squares, the scale and the weight in one pass (torch: ~8 launches).
- ``silu_and_mul``: one pass over [T, 2I] (torch: chunk views, silu, multiply).
- ``rotary``: one program per token rotates all its q and k heads in place (torch: ~20
  launches for gathers of cos/sin, upcasts, products, concatenation, downcasts).

Roundings match the references: the residual sum and SiLU's output are rounded to the model
dtype where torch rounds them. Inputs are [T, N] with unit stride in the last dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..worker.layer_ops import LayerOps, register_layer_ops


@triton.jit
def _rms_norm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31 in a long prefill
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + offs, mask=mask, other=0.0)  # model dtype
        tl.store(R + row * stride_r + offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + offs, h.to(x.dtype) * w, mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty_like(x)
    if rows:
        r = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), n, eps,
                                  HAS_RESIDUAL=residual is not None,
                                  BLOCK=triton.next_power_of_2(n),
                                  num_warps=_warps(n))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(_rows(x), None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Overwrites ``residual`` with ``x + residual`` and returns (norm of it, residual)."""
    residual = _rows(residual)
    return _norm(_rows(x), residual, weight, eps), residual


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31 in a long prefill
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + N + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded as torch's F.silu output
    tl.store(Y + row * stride_y + offs, act * up, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = _rows(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _rotate_heads(X, t, stride_t, stride_h, cos, sin, offs_d, mask_d, HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate-half of token t's [HEADS, 2 * HALF] block of X, in float32, in place."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < HEADS) & mask_d[None, :]
    first = X + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Cos, Sin, Pos, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(Cos + pos * stride_c + offs_d, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(Sin + pos * stride_c + offs_d, mask=mask_d, other=0.0)[None, :]
    _rotate_heads(Q, t, stride_qt, stride_qh, cos, sin, offs_d, mask_d, Q_HEADS, HALF, BLOCK_QH)
    _rotate_heads(K, t, stride_kt, stride_kh, cos, sin, offs_d, mask_d, K_HEADS, HALF, BLOCK_KH)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor):
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (strided views are fine as long as
    head_dim is contiguous) and returns them."""
    tokens, q_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rotary: q, k and the tables must be contiguous in head_dim")
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), Q_HEADS=q_heads, K_HEADS=k.shape[1], HALF=half,
            BLOCK_QH=triton.next_power_of_2(q_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(half))
    return q, k


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


TRITON_OPS = register_layer_ops(LayerOps("triton", rms_norm, add_rms_norm, silu_and_mul, rotary))
