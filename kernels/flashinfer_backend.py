"""The ``flashinfer`` attention backend: FlashInfer's paged-KV wrappers with page size 1.

With one token per page the KV buffers ``[num_slots, kv_heads, head_dim]`` are FlashInfer's
NHD paged cache viewed as ``[num_slots, 1, kv_heads, head_dim]``, a request's page list is its
row of the request-to-token table, and every last page holds exactly one token.

- decode-only batches: ``BatchDecodeWithPagedKVCacheWrapper``. For the batch sizes of
  ``cuda_graph.CUDA_GRAPH_BATCH_SIZES`` a wrapper built with ``use_cuda_graph=True`` (fixed
  buffers) is kept per size, so a captured graph stays valid; ``plan`` runs in ``prepare``,
  outside any graph, as FlashInfer requires. Other sizes share one plain wrapper.
- everything else: ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (FlashInfer
  aligns the causal mask to the end of the KV, which is what a cached prefix needs).

Importing this module needs ``flashinfer`` and a CUDA build of torch. It has not been run on
the project's CPU machines; ``kernels.pick_attention_backend`` imports it only on CUDA.
"""

from __future__ import annotations

import flashinfer
import torch

from ..worker.attention import AttentionBackend, AttentionMetadata, KVCache, \
    register_attention_backend
from .cuda_graph import CUDA_GRAPH_BATCH_SIZES
from .page_lists import page_lists
from .store_kv import store_kv

WORKSPACE_BYTES = 256 << 20


@register_attention_backend("flashinfer")
class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, device: torch.device | str = "cuda", model_config=None, **_):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError("attention_backend: flashinfer needs a CUDA device")
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        group = (model_config.num_heads // model_config.num_kv_heads) if model_config else 1
        # Grouped heads: the tensor-core (prefill-kernel) decode path wins from group 4 on.
        self.decode_tensor_cores = group >= 4
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_plain = None
        self.decode_graphed: dict[int, object] = {}
        self._indices_buf: torch.Tensor | None = None  # shared by the graph-safe wrappers
        self.num_heads: int | None = None  # this rank's query heads, learnt from q

    # ------------------------------------------------------------------------------------
    def _decode_wrapper(self, batch: int, kv: KVCache):
        if batch not in CUDA_GRAPH_BATCH_SIZES:
            if self.decode_plain is None:
                self.decode_plain = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
            return self.decode_plain
        wrapper = self.decode_graphed.get(batch)
        if wrapper is None:
            max_context = kv.req_to_token.shape[1]
            capacity = max(CUDA_GRAPH_BATCH_SIZES) * max_context  # no batch can list more
            if self._indices_buf is None or self._indices_buf.numel() < capacity:
                self._indices_buf = torch.empty(capacity, dtype=torch.int32, device=self.device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32,
                                                   device=self.device),
                paged_kv_indices_buffer=self._indices_buf,
                paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32,
                                                          device=self.device))
            self.decode_graphed[batch] = wrapper
        return wrapper

    def prepare(self, meta: AttentionMetadata, kv: KVCache) -> None:
        """Builds the page lists and plans the batch on the decode or prefill wrapper. Host
        work: call outside CUDA graphs. Until the first forward has shown the number of
        query heads of this rank, planning waits for that forward."""
        self.meta, self.kv = meta, kv
        self._page_lists = page_lists(kv.req_to_token, meta.req_rows, [
            p + e for p, e in zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)])
        self._planned = False
        if self.num_heads is not None:
            self._plan()

    def _plan(self) -> None:
        indptr, indices, last_page_len = self._page_lists
        meta, kv = self.meta, self.kv
        _, kv_heads, head_dim = kv.k[0].shape
        dtype = kv.k[0].dtype
        if meta.decode_only:
            self.wrapper = self._decode_wrapper(len(meta.extend_lens_cpu), kv)
            self.wrapper.plan(indptr, indices, last_page_len, self.num_heads, kv_heads,
                              head_dim, 1, q_data_type=dtype, kv_data_type=dtype)
        else:
            qo_indptr = torch.zeros_like(indptr)  # on the host, as indptr
            qo_indptr[1:] = torch.tensor(meta.extend_lens_cpu, dtype=torch.int32).cumsum(0)
            self.wrapper = self.prefill
            self.wrapper.plan(qo_indptr, indptr, indices, last_page_len, self.num_heads,
                              kv_heads, head_dim, 1, causal=True, q_data_type=dtype,
                              kv_data_type=dtype)
        self._planned = True

    def forward(self, layer_id, q, k, v):
        meta, kv = self.meta, self.kv
        k_buf, v_buf = kv.k[layer_id], kv.v[layer_id]
        store_kv(k_buf, v_buf, meta.out_cache_loc, k, v)
        if not self._planned:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer backend: run one eager batch before capturing "
                                   "a CUDA graph (planning cannot happen inside a graph)")
            self.num_heads = q.shape[1]
            self._plan()
        out = self.wrapper.run(q.contiguous(), (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        return out.reshape(q.shape[0], -1)
