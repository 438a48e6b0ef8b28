"""Extend (prefill / chunked prefill / cached-prefix) attention over token-granular KV slots.

Request ``b`` brings ``extend_lens[b]`` new tokens at positions ``prefix_lens[b] + i``; new
token ``i`` attends to positions ``0 .. prefix_lens[b] + i``. Every position's K/V, the cached
prefix's and the new tokens' alike, is read through ``req_to_token[rows[b], p]`` (the backend
stores the new tokens' K/V before calling this), so a prefix shared through the radix cache
sits in arbitrary slots at no extra cost.

One program per (request, query head, block of BLOCK_M new tokens), flash-attention style
online softmax. The keys a block sees split in two ranges: ``[0, prefix + m0)`` is visible to
every row of the block (no causal mask), ``[prefix + m0, prefix + m0 + BLOCK_M)`` needs it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_attention import LOG2E


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, K, V, Table, row, kv_head, lo, hi, qk_scale,
            stride_kn, stride_kh, stride_vn, stride_vh, stride_tr,
            CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(Q, K, V, O, Table, Rows, PrefixLens, ExtendLens, QStarts, qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kn, stride_kh, stride_vn, stride_vh, stride_tr,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    extend = tl.load(ExtendLens + b).to(tl.int32)
    if m0 < extend:
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        row = tl.load(Rows + b)
        q_start = tl.load(QStarts + b)
        kv_head = head // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend
        mask_d = offs_d < HEAD_DIM
        io_mask = mask_m[:, None] & mask_d[None, :]
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                    + offs_d[None, :], mask=io_mask, other=0.0)
        q_pos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        diagonal = prefix + m0  # keys below this are visible to every row of the block
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, K, V, Table, row, kv_head, 0, diagonal,
                                qk_scale, stride_kn, stride_kh, stride_vn, stride_vh, stride_tr,
                                False, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)
        kv_end = tl.minimum(diagonal + BLOCK_M, prefix + extend)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, K, V, Table, row, kv_head, diagonal,
                                kv_end, qk_scale, stride_kn, stride_kh, stride_vn, stride_vh,
                                stride_tr, True, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)
        out = acc / l_i[:, None]  # every row sees at least key 0
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=io_mask)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int,
                     block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 2) -> torch.Tensor:
    """Causal attention of every new token over its request's slots. Returns a new [T, Hq, D].

    q: [T, Hq, D], the requests' new tokens concatenated, request b's starting at
    ``q_starts[b]``; rows, prefix_lens, extend_lens, q_starts: [B]; ``max_extend`` (host int)
    sizes the grid. The new tokens' K/V must already sit in their slots. Mutates nothing.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    if heads % kv_heads:
        raise ValueError(f"extend_attention: {heads} query heads are not a multiple of "
                         f"{kv_heads} KV heads")
    out = torch.empty_like(q)
    batch = rows.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (batch, heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
        LOG2E / math.sqrt(head_dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    return out
