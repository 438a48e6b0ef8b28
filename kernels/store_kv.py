"""Write the new tokens' K and V into their KV slots, both buffers in one launch.

Reference: ``k_buf[loc] = k; v_buf[loc] = v`` (two index_put launches). The kernel runs one
program per new token and copies that token's ``[kv_heads, head_dim]`` block of K and of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(K, V, KBuf, VBuf, Loc,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_bn, stride_bh,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t x stride passes 2**31 in a long extend
    slot = tl.load(Loc + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * stride_bn + offs_h[:, None] * stride_bh + offs_d[None, :]
    tl.store(KBuf + dst, k, mask=mask)
    tl.store(VBuf + dst, v, mask=mask)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Mutates ``k_buf[loc[t]]`` and ``v_buf[loc[t]]`` for every new token t.

    k_buf, v_buf: [num_slots, kv_heads, head_dim]; loc: [T] int64; k, v: [T, kv_heads,
    head_dim], each token's block contiguous in head_dim (views of a fused qkv are fine).
    """
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_buf", k_buf), ("v_buf", v_buf)):
        if t.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in head_dim")
    if k_buf.stride() != v_buf.stride():
        raise ValueError("store_kv: k_buf and v_buf must share one layout")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))
