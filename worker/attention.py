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

from .cascade_attention import PaddedCall, buckets, find_shared_prefixes, merge_attention
from .kv_stage import KVStage

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
    """Reference backend in plain torch, built for the CPU's strengths: few large calls.

    Each batch is planned once, in ``prepare``:

    - Fresh prompts of one length (nothing cached): one causal SDPA with ``is_causal`` and no
      mask, which lets CPU SDPA use its flash kernel; a fresh prompt among others: one such
      call of its own.
    - Requests with a cached prefix (every decode, extends over the radix cache): requests
      that share a prefix (same slots) read it once per group and their own keys apart, the
      two merged by log-sum-exp (``cascade_attention``). Own parts and group prefixes each go
      into as few padded calls as keep the padding within ``PAD_WASTE`` x the real work.
    """

    PAD_WASTE = 2.0
    SMALL_CALL = 1 << 15  # query-key pairs: below this, padding beats a second call
    CASCADE = True  # read shared prefixes once per group (tests switch it off to compare)
    STAGE_BYTES = 1 << 28  # gathered K/V kept across decode steps (kv_stage.py); 0: off

    def __init__(self, **_):
        self.meta: AttentionMetadata | None = None
        self.scratch: dict[str, torch.Tensor] = {}  # gathered K/V rows, reused layer to layer
        self.stage = KVStage(self.STAGE_BYTES)

    def prepare(self, meta: AttentionMetadata, kv: KVCache) -> None:
        self.meta, self.kv = meta, kv
        prefix, extend = meta.prefix_lens_cpu, meta.extend_lens_cpu
        self.starts = [0]
        for e in extend:
            self.starts.append(self.starts[-1] + e)
        self.own_calls: list[PaddedCall] = []
        self.shared_calls: list[PaddedCall] = []
        self.fresh = [b for b, p in enumerate(prefix) if p == 0]
        self.one_fresh_batch = len(self.fresh) == len(prefix) and len(set(extend)) == 1
        cached = [b for b, p in enumerate(prefix) if p > 0]
        if not cached:
            self.stage.clear()
            return
        table = kv.req_to_token[meta.req_rows, : max(p + e for p, e in zip(prefix, extend))]
        groups = find_shared_prefixes(table, cached, prefix) if self.CASCADE else []
        skip = [0] * len(prefix)  # positions each request reads in its group's call
        for g in groups:
            for b in g.members:
                skip[b] = g.length
        own_sizes = [(extend[b], prefix[b] + extend[b] - skip[b]) for b in cached]
        for call in buckets(own_sizes, self.PAD_WASTE, self.SMALL_CALL):
            self.own_calls.append(PaddedCall.for_requests(
                table, [cached[i] for i in call], prefix, extend, skip, self.starts))
        group_sizes = [(sum(extend[b] for b in g.members), g.length) for g in groups]
        for call in buckets(group_sizes, self.PAD_WASTE, self.SMALL_CALL):
            self.shared_calls.append(PaddedCall.for_groups([groups[i] for i in call], table,
                                                           self.starts))
        self._plan_stage(meta, kv)

    def _plan_stage(self, meta: AttentionMetadata, kv: KVCache) -> None:
        """Decode steps reuse last step's gathered K/V (own keys grow by one per step, shared
        prefixes stay); any other step changes slots the stage cannot follow, so it is
        dropped."""
        if not meta.decode_only:
            self.stage.clear()
            return
        calls = {("own", i): (c.slots, c.key_lens, 1) for i, c in enumerate(self.own_calls)}
        calls.update({("shared", i): (c.slots, c.key_lens, 0)
                      for i, c in enumerate(self.shared_calls)})
        buf = kv.k[0]
        self.stage.plan(calls, (len(kv.k), buf.shape[1], buf.shape[2], buf.element_size()),
                        buf.dtype, buf.device)

    def _keys_values(self, name, call: PaddedCall, layer_id, k_buf, v_buf, k, v):
        """[n, S, Hkv, D] keys and values of ``call``: staged, or gathered for this layer."""
        def gather(buf, slots, tag):  # into scratch reused by every layer and step
            return gather_slots(buf, slots, self.scratch, name[0] + tag)

        new = call.q_index[:, 0]  # decode: each row's one new token
        staged = self.stage.keys_values(name, layer_id, gather, k_buf, v_buf,
                                        lambda: k[new], lambda: v[new])
        if staged is not None:
            return staged
        return gather(k_buf, call.slots, "k"), gather(v_buf, call.slots, "v")

    def forward(self, layer_id, q, k, v):
        meta, kv = self.meta, self.kv
        k_buf, v_buf = kv.k[layer_id], kv.v[layer_id]
        k_buf[meta.out_cache_loc] = k
        v_buf[meta.out_cache_loc] = v
        if self.one_fresh_batch:  # new prompts of one length: nothing cached to read
            batch, length = len(meta.extend_lens_cpu), meta.extend_lens_cpu[0]
            by_request = lambda x: x.view(batch, length, *x.shape[1:]).transpose(1, 2)  # noqa: E731
            out = F.scaled_dot_product_attention(by_request(q), by_request(k), by_request(v),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(batch * length, -1)  # [T, Hq * D]
        out = torch.empty_like(q)  # [T, Hq, D]
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [T, Hq]

        for i, call in enumerate(self.own_calls):
            keys, values = self._keys_values(("own", i), call, layer_id, k_buf, v_buf, k, v)
            out[call.tokens], lse[call.tokens] = call.attend(q, keys, values)
        for i, call in enumerate(self.shared_calls):
            keys, values = self._keys_values(("shared", i), call, layer_id, k_buf, v_buf, k, v)
            shared, shared_lse = call.attend(q, keys, values)
            t = call.tokens
            merged, lse[t] = merge_attention(out[t], lse[t], shared, shared_lse)
            out[t] = merged.to(out.dtype)  # (the merge runs in float32, as the lse)
        for b in self.fresh:  # a fresh prompt's keys are its new ones: plain causal
            start, end = self.starts[b], self.starts[b + 1]
            # 4-D [1, H, L, D]: CPU SDPA takes its flash kernel only for 4-D inputs
            by_head = lambda x: x[start:end].transpose(0, 1).unsqueeze(0)  # noqa: E731
            out[start:end] = F.scaled_dot_product_attention(
                by_head(q), by_head(k), by_head(v), is_causal=True, enable_gqa=True
            )[0].transpose(0, 1)
        return out.view(q.shape[0], -1)
