"""Decode attention over token-granular KV slots: one new query token per request.

Request ``b`` attends to positions ``0 .. seq_lens[b] - 1`` whose K/V live in slots
``req_to_token[rows[b], p]``. Two kernels (flash-decoding):

1. ``_decode_split_kernel``, grid ``(kv_heads, B, num_splits)``: each program takes one
   request, one KV head and one contiguous chunk of the context, and computes a partial softmax
   for *all* query heads of that KV head's group at once (the group is padded to 16 rows so
   ``tl.dot`` can use tensor cores; each K/V block is loaded once for the whole group).
   It writes a normalised partial output and its log-sum-exp (base 2).
2. ``_decode_combine_kernel``, grid ``(B, q_heads)``: merges the splits by their LSEs.

Splitting the context keeps the GPU busy when ``B * kv_heads`` alone is too few programs
(batch 1 of Llama-3-8B is 8 programs for 132 SMs). The number of splits depends on the batch
shape only, never on the context lengths, so a CUDA graph captured for a batch size stays valid.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 16


@triton.jit
def _decode_split_kernel(Q, K, V, Table, Rows, SeqLens, MidO, MidLse, qk_scale,
                         stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_tr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr):
    kv_head = tl.program_id(0)  # fastest-varying: a request's heads run side by side, and
    b = tl.program_id(1)  # their 256-byte reads of a slot fall in one 2 KB stretch of HBM
    split = tl.program_id(2)
    row = tl.load(Rows + b)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    # contiguous chunks, each a whole number of blocks; trailing splits may be empty
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(Table + row * stride_tr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        # V is issued with K, not after the softmax: both depend only on the slots, and
        # having both reads in flight at once is what keeps HBM busy
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    mid = b * stride_mb + heads * stride_mh + split * stride_ms
    if NUM_SPLITS == 1:  # the partial output is the output: MidO is O, no combine pass
        tl.store(MidO + mid[:, None] + offs_d[None, :], out.to(MidO.dtype.element_ty),
                 mask=mask_h[:, None] & mask_d[None, :])
    else:
        tl.store(MidO + mid[:, None] + offs_d[None, :], out,
                 mask=mask_h[:, None] & mask_d[None, :])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_combine_kernel(MidO, MidLse, O, stride_mb, stride_mh, stride_ms, stride_lb,
                           stride_lh, stride_ob, stride_oh,
                           HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    base = b * stride_mb + h * stride_mh
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds keys, so the max is finite
    parts = tl.load(MidO + base + offs_s[:, None] * stride_ms + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


# Programs to aim for per SM. Few resident programs fit an SM at once (each holds pipelined K
# and V tiles in shared memory), so with one program per (request, KV head) a batch-128 grid is
# about one wave and a ragged second one that leaves most SMs idle; several waves bound that
# tail loss, while each extra split adds a partial output to write and merge (2 x group x
# splits / context of the KV bytes read: 3% for groups of 4, 4 splits, 1k contexts).
# bench/gpu_kernels.py sweeps the split count to check this choice.
PROGRAMS_PER_SM = 16


def num_decode_splits(batch_size: int, kv_heads: int, sm_count: int | None) -> int:
    """Splits per (request, KV head) for about PROGRAMS_PER_SM programs per SM;
    1..MAX_SPLITS. Depends on the batch shape only (see the module docstring)."""
    if sm_count is None:  # CPU / interpreter: a fixed small split count exercises the merge
        return 2
    programs = PROGRAMS_PER_SM * sm_count
    return max(1, min(MAX_SPLITS, math.ceil(programs / (batch_size * kv_heads))))


class DecodeWorkspace:
    """Partial-output buffers of the split kernel, one pair per (B, heads, splits, dim) shape.

    Buffers are kept so a captured CUDA graph keeps reading the same addresses."""

    def __init__(self):
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, batch: int, heads: int, splits: int, head_dim: int, device) -> tuple:
        key = (batch, heads, splits, head_dim, str(device))
        if key not in self._buffers:
            self._buffers[key] = (
                torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=device),
                torch.empty((batch, heads, splits), dtype=torch.float32, device=device))
        return self._buffers[key]


# Block shapes of the split kernel. Serving uses a fixed one per device (no tuning at start-up,
# where the KV pool is empty and contexts are meaningless): DECODE_CONFIG_BY_DEVICE, measured
# offline with bench/gpu_kernels.py, which runs the autotuner over DECODE_CONFIGS on realistic
# contexts and prints what it picked; a device missing from the table gets the first entry.
DECODE_CONFIGS = [dict(BLOCK_N=64, num_warps=4, num_stages=2),
                  dict(BLOCK_N=32, num_warps=4, num_stages=2),
                  dict(BLOCK_N=64, num_warps=4, num_stages=3),
                  dict(BLOCK_N=64, num_warps=8, num_stages=2),
                  dict(BLOCK_N=128, num_warps=4, num_stages=2),
                  dict(BLOCK_N=128, num_warps=8, num_stages=2)]
DECODE_CONFIG_BY_DEVICE: dict[str, dict] = {}  # device name substring -> config; none yet
_tuned_split_kernel = triton.autotune(
    configs=[triton.Config({"BLOCK_N": c["BLOCK_N"]}, num_warps=c["num_warps"],
                           num_stages=c["num_stages"]) for c in DECODE_CONFIGS],
    key=["GROUP", "HEAD_DIM", "NUM_SPLITS"])(_decode_split_kernel)


def device_decode_config(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((c for key, c in DECODE_CONFIG_BY_DEVICE.items() if key in name),
                DECODE_CONFIGS[0])


def tuned_decode_configs() -> dict:
    """What the autotuner picked so far: {(group, head_dim, splits, ...): config string}."""
    return {key: str(cfg) for key, cfg in _tuned_split_kernel.cache.items()}


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     num_splits: int, workspace: DecodeWorkspace | None = None,
                     config: dict | str | None = None) -> torch.Tensor:
    """Attention of one query token per request over its slots. Returns a new [B, Hq, D].

    q: [B, Hq, D]; k_buf, v_buf: [num_slots, Hkv, D]; req_to_token: [R, L] int64;
    rows, seq_lens: [B] (every seq_len >= 1). Mutates only the workspace buffers.
    ``config``: a DECODE_CONFIGS entry to force; None: the device's (device_decode_config);
    "autotune" (GPU only): the autotuner's pick for this (group, head_dim, splits), found
    on this call's inputs the first time the shape is seen.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    batch, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    if heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads are not a multiple of "
                         f"{kv_heads} KV heads")
    group = heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits == 1:  # the split kernel writes ``out`` itself (its "split" stride is 0)
        mid_o, mid_lse = out, out
        mid_strides = (out.stride(0), out.stride(1), 0, 0, 0)
    else:
        mid_o, mid_lse = (workspace or DecodeWorkspace()).get(batch, heads, num_splits,
                                                              head_dim, q.device)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
                       mid_lse.stride(1))
    block_d = triton.next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is unused for 16-bit
    if config == "autotune":
        kernel, config = _tuned_split_kernel, {}
    else:
        kernel, config = _decode_split_kernel, config or device_decode_config(q.device)
    kernel[(kv_heads, batch, num_splits)](
        q, k_buf, v_buf, req_to_token, rows, seq_lens, mid_o, mid_lse,
        LOG2E / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0), *mid_strides,
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        PRECISION=precision, **config)
    if num_splits > 1:
        _decode_combine_kernel[(batch, heads)](
            mid_o, mid_lse, out, *mid_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    return out
