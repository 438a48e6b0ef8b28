"""The ``triton`` attention backend: the Triton kernels of this folder behind the
``AttentionBackend`` interface of ``worker/attention.py``.

Per layer: one fused K/V store into the slots, then decode attention (decode-only batches) or
extend attention (everything else: prefill, chunks, cached prefixes, mixed batches).

CUDA graphs: ``prepare`` runs outside the graph before every replay and writes what ``forward``
reads into buffers kept per batch size, so a graph captured once keeps reading current values.
"""

from __future__ import annotations

import torch

from ..worker.attention import AttentionBackend, AttentionMetadata, KVCache, \
    register_attention_backend
from .decode_attention import (DecodeWorkspace, decode_attention, device_decode_config,
                               num_decode_splits)
from .extend_attention import extend_attention
from .store_kv import store_kv


@register_attention_backend("triton")
class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, device: torch.device | str = "cpu", **_):
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.sm_count = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if on_gpu else None)
        # Block sizes: decode's come from decode_attention.device_decode_config; extend's are
        # sized for head_dim 128 on Hopper-class parts; on the CPU interpreter
        # larger blocks only cost time.
        self.extend_cfg = (dict(block_m=128, block_n=64, num_warps=8, num_stages=2) if on_gpu
                           else dict(block_m=32, block_n=32))
        self.workspace = DecodeWorkspace()
        self.decode_config = device_decode_config(self.device)
        self._seq_lens: dict[int, torch.Tensor] = {}  # batch size -> buffer (graph-stable)
        self.meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata, kv: KVCache) -> None:
        """Derives per-batch tensors from ``meta``; in decode mode writes them into this
        backend's per-batch-size buffers in place (no host sync)."""
        self.meta, self.kv = meta, kv
        batch = len(meta.extend_lens_cpu)
        if meta.decode_only:
            buf = self._seq_lens.get(batch)
            if buf is None:
                buf = self._seq_lens[batch] = torch.empty(batch, dtype=torch.int64,
                                                          device=meta.prefix_lens.device)
            torch.add(meta.prefix_lens, meta.extend_lens, out=buf)
            self.seq_lens = buf
            self.num_splits = num_decode_splits(batch, kv.k[0].shape[1], self.sm_count)
        else:
            self.q_starts = torch.cumsum(meta.extend_lens, 0) - meta.extend_lens
            self.max_extend = max(meta.extend_lens_cpu)

    def forward(self, layer_id, q, k, v):
        meta, kv = self.meta, self.kv
        k_buf, v_buf = kv.k[layer_id], kv.v[layer_id]
        store_kv(k_buf, v_buf, meta.out_cache_loc, k, v)
        if meta.decode_only:
            out = decode_attention(q, k_buf, v_buf, kv.req_to_token, meta.req_rows,
                                   self.seq_lens, self.num_splits, self.workspace,
                                   self.decode_config)
        else:
            out = extend_attention(q, k_buf, v_buf, kv.req_to_token, meta.req_rows,
                                   meta.prefix_lens, meta.extend_lens, self.q_starts,
                                   self.max_extend, **self.extend_cfg)
        return out.reshape(q.shape[0], -1)
