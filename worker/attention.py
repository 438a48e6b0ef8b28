"""Attention over token-granular KV slots, behind a small backend registry.

The KV of a request is not contiguous: position ``p`` of the request in table row ``r`` lives in
slot ``req_to_token[r, p]`` of every layer's K and V buffers. A backend first stores the new
tokens' K/V at ``out_cache_loc``, then attends each new token to its request's slots
``0 .. prefix_len + i`` (causal within the extend part).

``torch_native`` is the reference: plain torch, runs on CPU and GPU. GPU kernels (``kernels/``)
register further backends under their own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS: dict[str, Callable[..., "AttentionBackend"]] = {}


def register_attention_backend(name: str):
    def wrap(cls):
        ATTENTION_BACKENDS[name] = cls
        return cls
    return wrap


def create_attention_backend(name: str, **kwargs) -> "AttentionBackend":
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; available: "
                         f"{sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name](**kwargs)


class KVCache:
    """Per-layer K and V buffers, ``[num_slots, kv_heads_local, head_dim]``, plus this worker's
    mirror of the request-to-token table (filled from each batch's slot lists)."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, max_requests: int,
                 max_context_len: int):
        shape = (num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int64,
                                        device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def gather_slots(buf: torch.Tensor, slots: torch.Tensor,
                 scratch: dict | None = None, name: str = "") -> torch.Tensor:
    """``buf[slots]`` for a contiguous [num_slots, H, D] buffer: [*slots.shape, H, D].

    ``index_select`` over the buffer's rows copies whole rows (advanced indexing goes element
    by element: ~5x slower on CPU). With ``scratch`` (a dict the caller keeps) the rows land in
    a reused buffer under ``name``: a fresh multi-MB tensor per layer costs page faults that
    take longer than the copy. The result is only valid until the next call with that name."""
    rows = buf.view(buf.shape[0], -1)
    index = slots.reshape(-1)
    if scratch is None:
        out = torch.index_select(rows, 0, index)
    else:
        held = scratch.get(name)
        if (held is None or held.shape[0] < index.numel() or held.shape[1] != rows.shape[1]
                or held.dtype != rows.dtype or held.device != rows.device):
            held = scratch[name] = torch.empty((max(index.numel(), 1), rows.shape[1]),
                                               dtype=rows.dtype, device=rows.device)
        out = torch.index_select(rows, 0, index, out=held[: index.numel()])
    return out.view(*slots.shape, *buf.shape[1:])


@dataclass
class AttentionMetadata:
    """What every layer's attention needs to know about the batch (device tensors)."""

    req_rows: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    out_cache_loc: torch.Tensor  # [T]
    # host copies for Python-side loops
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    decode_only: bool

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens


class AttentionBackend:
    """Interface: ``prepare(meta, kv)`` once per batch, then ``forward`` once per layer."""

    def prepare(self, meta: AttentionMetadata, kv: KVCache) -> None:
        raise NotImplementedError

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq * D]."""
        raise NotImplementedError


@register_attention_backend("torch_native")
class TorchNativeBackend(AttentionBackend):
    """Reference backend. Decode-only batches gather every request's slots into one padded
    ``[B, L]`` block and run one masked SDPA. Extend batches do the same with queries padded to
    ``[B, E]`` when the padding costs at most ``PAD_WASTE`` x the real work (many short
    extends over cached prefixes, the shared-prefix case: one call instead of B), and run one
    causal SDPA per request otherwise (one long prompt beside short ones). Fresh prompts
    (nothing cached) attend to their own new keys with ``is_causal`` and no mask, which lets
    CPU SDPA use its flash kernel (3x faster than a masked call at 2k tokens)."""

    PAD_WASTE = 2.0

    def __init__(self, **_):
        self.meta: AttentionMetadata | None = None
        self.scratch: dict[str, torch.Tensor] = {}  # gathered K/V rows, reused layer to layer

    def prepare(self, meta: AttentionMetadata, kv: KVCache) -> None:
        self.meta, self.kv = meta, kv
        if meta.decode_only:
            max_len = max(p + e for p, e in zip(meta.prefix_lens_cpu, meta.extend_lens_cpu))
            seq_lens = meta.seq_lens
            self.slots = kv.req_to_token[meta.req_rows, :max_len]  # [B, L]
            self.valid = (torch.arange(max_len, device=seq_lens.device)[None, :]
                          < seq_lens[:, None])  # [B, L]
        elif all(p == 0 for p in meta.prefix_lens_cpu) and len(set(meta.extend_lens_cpu)) == 1:
            self.mode = "fresh"
        elif self._padding_pays(meta):
            self.mode = "padded"
            self._prepare_padded_extend(meta, kv)
        else:
            self.mode = "per_request"
            self.row_slots = []
            for row, prefix, extend in zip(meta.req_rows.tolist(), meta.prefix_lens_cpu,
                                           meta.extend_lens_cpu):
                self.row_slots.append(kv.req_to_token[row, : prefix + extend])

    def _padding_pays(self, meta: AttentionMetadata) -> bool:
        lens = list(zip(meta.prefix_lens_cpu, meta.extend_lens_cpu))
        if len(lens) < 2:
            return False
        real = sum(e * (p + e) for p, e in lens)
        padded = len(lens) * max(e for _, e in lens) * max(p + e for p, e in lens)
        return padded <= self.PAD_WASTE * real

    def _prepare_padded_extend(self, meta: AttentionMetadata, kv: KVCache) -> None:
        """Index and mask tensors for one SDPA over the whole extend batch."""
        dev = meta.extend_lens.device
        extend, prefix = meta.extend_lens, meta.prefix_lens
        max_extend = max(meta.extend_lens_cpu)
        max_len = max(p + e for p, e in zip(meta.prefix_lens_cpu, meta.extend_lens_cpu))
        t = torch.arange(max_extend, device=dev)
        self.q_valid = t[None, :] < extend[:, None]  # [B, E]
        starts = torch.cumsum(extend, 0) - extend
        self.q_index = torch.where(self.q_valid, starts[:, None] + t[None, :], 0)  # [B, E]
        self.slots = kv.req_to_token[meta.req_rows, :max_len]  # [B, L]
        # new token t of request b sits at position prefix_b + t and sees keys 0 .. prefix_b + t;
        # padded query rows see every key (their output is dropped; an empty row would be NaN)
        keys = torch.arange(max_len, device=dev)
        causal = keys[None, None, :] <= (prefix[:, None, None] + t[None, :, None])  # [B, E, L]
        self.mask = (causal | ~self.q_valid[:, :, None])[:, None]  # [B, 1, E, L]

    def forward(self, layer_id, q, k, v):
        meta, kv = self.meta, self.kv
        k_buf, v_buf = kv.k[layer_id], kv.v[layer_id]
        k_buf[meta.out_cache_loc] = k
        v_buf[meta.out_cache_loc] = v
        if meta.decode_only:
            return self._decode(q, k_buf, v_buf)
        return self._extend(q, k, v, k_buf, v_buf)

    def _decode(self, q, k_buf, v_buf):
        batch, heads, dim = q.shape
        # [B, Hkv, L, D]
        keys = gather_slots(k_buf, self.slots, self.scratch, "k").transpose(1, 2)
        values = gather_slots(v_buf, self.slots, self.scratch, "v").transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values,  # q: [B, Hq, 1, D]
            attn_mask=self.valid[:, None, None, :], enable_gqa=True)
        return out.reshape(batch, heads * dim)

    def _extend(self, q, k, v, k_buf, v_buf):
        if self.mode == "fresh":  # new prompts of one length: nothing cached to read
            batch, length = len(self.meta.extend_lens_cpu), self.meta.extend_lens_cpu[0]
            by_request = lambda x: x.view(batch, length, *x.shape[1:]).transpose(1, 2)  # noqa: E731
            out = F.scaled_dot_product_attention(by_request(q), by_request(k), by_request(v),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(batch * length, -1)  # [T, Hq * D]
        if self.mode == "padded":
            q_pad = q[self.q_index].transpose(1, 2)  # [B, Hq, E, D]
            out = F.scaled_dot_product_attention(
                q_pad, gather_slots(k_buf, self.slots, self.scratch, "k").transpose(1, 2),
                gather_slots(v_buf, self.slots, self.scratch, "v").transpose(1, 2),
                attn_mask=self.mask, enable_gqa=True)  # [B, Hq, E, D]
            out = out.transpose(1, 2)[self.q_valid]  # [T, Hq, D], the batch's token order
            return out.reshape(out.shape[0], -1)
        meta = self.meta
        outputs, start = [], 0
        for slots, prefix, extend in zip(self.row_slots, meta.prefix_lens_cpu,
                                         meta.extend_lens_cpu):
            q_i = q[start : start + extend].transpose(0, 1)  # [Hq, E, D]
            if prefix == 0:  # a fresh prompt: its keys are the new ones, plain causal
                out = F.scaled_dot_product_attention(
                    q_i, k[start : start + extend].transpose(0, 1),
                    v[start : start + extend].transpose(0, 1), is_causal=True, enable_gqa=True)
                outputs.append(out.transpose(0, 1).reshape(extend, -1))
                start += extend
                continue
            keys = gather_slots(k_buf, slots, self.scratch, "k").transpose(0, 1)  # [Hkv, S, D]
            values = gather_slots(v_buf, slots, self.scratch, "v").transpose(0, 1)
            # new token i sits at position prefix + i and sees positions 0 .. prefix + i
            causal = (torch.arange(prefix + extend, device=q.device)[None, :]
                      <= torch.arange(prefix, prefix + extend, device=q.device)[:, None])
            out = F.scaled_dot_product_attention(q_i, keys, values, attn_mask=causal,
                                                 enable_gqa=True)
            outputs.append(out.transpose(0, 1).reshape(extend, -1))
            start += extend
        return torch.cat(outputs, dim=0)
