"""ModelRunner: one rank's model, KV buffers and sampler; turns a ForwardBatch into tokens.

Per batch: write the batch's slot lists into this worker's request-to-token mirror, run the
model over the new tokens only, take logits at each request's last new token (and at the
positions whose input logprobs were asked for), sample. Only rank 0's sampled tokens are used;
every rank runs the same code so collectives line up.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..kernels import pick_attention_backend, pick_layer_ops
from .attention import AttentionMetadata, KVCache, create_attention_backend
from .forward_batch import ForwardBatch, ForwardOutput
from .host_copy import to_device
from .host_pool import HostKVPool, host_pool_tokens
from .loader import load_weights
from .model_config import ModelConfig
from .models import MODEL_REGISTRY
from .parallel import TensorParallel
from .sampler import Sampler, token_logprobs, top_logprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)
CPU_KV_BUDGET_BYTES = 1 << 30  # default KV pool on CPU when neither size nor fraction is given
MAX_DEFAULT_TOKENS = 1 << 17


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "cpu"
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from memory
    mem_fraction_static: float = 0.85  # GPU: share of device memory for weights + KV
    max_running_requests: int | None = None
    max_context_len: int | None = None
    page_size: int = 1
    attention_backend: str = "auto"  # best available: flashinfer > triton on CUDA, else torch
    layer_ops: str = "auto"  # norms, SiLU, RoPE: fused triton kernels on CUDA, else torch
    disable_cuda_graph: bool = False
    load_format: str = "safetensors"  # or "dummy": random weights, for GPU benchmarks
    tp_rank: int = 0
    tp_size: int = 1
    seed: int = 0
    # Hierarchical cache: a host pool of hicache_ratio x max_total_tokens tokens, or of
    # hicache_size GB when > 0 (see host_pool.py); the scheduler reads host_pool_tokens.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    ranks_on_host: int = 1  # ranks of this replica on this host, sharing its host memory
    # EOS ids besides the model config's (the tokenizer's): min_new_tokens blocks them all
    eos_token_ids: tuple[int, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}; use auto or one of "
                             f"{sorted(_DTYPES)}")
        return _DTYPES[self.dtype]


class ModelRunner:
    def __init__(self, cfg: RunnerConfig):
        self.cfg = cfg
        self.tp = TensorParallel(cfg.tp_rank, cfg.tp_size)
        self.device = torch.device(cfg.device)
        # Overlap scheduling pays when the forward runs beside the scheduler's Python: GPU
        # kernels run asynchronously. On CPU the forward thread needs the GIL between its many
        # small ops and the cores the scheduler uses, so in one process it is off by default.
        self.overlap_by_default = self.device.type != "cpu"
        self.model_config = mc = ModelConfig.from_pretrained(cfg.model_path)
        dtype = cfg.torch_dtype
        torch.manual_seed(cfg.seed)
        self.model = self._build_model(mc, dtype)
        self.max_context_len = cfg.max_context_len or mc.context_len
        if self.max_context_len > mc.context_len:  # the RoPE tables end there
            raise ValueError(f"context_length: {self.max_context_len} exceeds the model's "
                             f"max_position_embeddings ({mc.context_len})")
        self.max_running_requests = cfg.max_running_requests or 256
        kv_heads = self.tp.kv_head_range(mc.num_kv_heads)[1]
        self.max_total_tokens = self._pool_size(mc, kv_heads, dtype)
        # slots 0 .. max_total_tokens (slot 0 = padding); rounded up to whole pages
        num_slots = (self.max_total_tokens // cfg.page_size + 1) * cfg.page_size
        self.kv = KVCache(mc.num_layers, num_slots, kv_heads, mc.head_dim, dtype, self.device,
                          self.max_running_requests, self.max_context_len)
        self.host_pool: HostKVPool | None = None
        if cfg.enable_hierarchical_cache:
            tokens = host_pool_tokens(
                self.max_total_tokens, KVCache.bytes_per_token(mc.num_layers, kv_heads,
                                                               mc.head_dim, dtype),
                cfg.hicache_ratio, cfg.hicache_size, cfg.page_size)
            self.host_pool = HostKVPool.try_create(tokens, cfg.page_size, mc.num_layers,
                                                   kv_heads, mc.head_dim, dtype, self.device,
                                                   ranks_on_host=cfg.ranks_on_host)
            if self.host_pool is not None and tokens <= self.max_total_tokens:
                log.warning("the host KV pool (%d tokens) is not larger than the device pool "
                            "(%d): a prefix is copied to the host only if it fits there, so "
                            "expect few host hits; raise --hicache-ratio above 1",
                            tokens, self.max_total_tokens)
        self.host_pool_tokens = self.host_pool.num_tokens if self.host_pool else 0
        self.attention_backend = pick_attention_backend(cfg.attention_backend, self.device,
                                                        mc.head_dim, dtype)
        self.attn = create_attention_backend(self.attention_backend, device=self.device,
                                             model_config=mc)
        # the ids that end a request: the scheduler stops on these, the sampler holds them
        # back below min_new_tokens (with only the config's, a tokenizer EOS got through)
        self.eos_token_ids = tuple(sorted({*mc.eos_token_ids, *cfg.eos_token_ids}))
        self.sampler = Sampler(self.eos_token_ids, seed=cfg.seed)
        # Overlap scheduling's output buffer: the last token sampled for each table row. A
        # decode input of -r means "the token this worker sampled for row r last step". -1
        # marks a row with nothing written yet; reading it is a scheduler bug and raises
        # (checked against the host mirror future_ready, which never waits for the device).
        self.future_tokens = torch.full((self.max_running_requests + 1,), -1, dtype=torch.int64,
                                        device=self.device)
        self.future_ready = torch.zeros(self.max_running_requests + 1, dtype=torch.bool)  # host
        self._executor: ThreadPoolExecutor | None = None  # see submit
        self.graphs = None  # CUDA graphs of decode batches, when the backend allows them
        if (self.device.type == "cuda" and not cfg.disable_cuda_graph
                and getattr(self.attn, "supports_cuda_graph", False)):
            from ..kernels.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self)

    def _build_model(self, mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            ops = pick_layer_ops(self.cfg.layer_ops, self.device)
            with torch.device(self.device):
                model = MODEL_REGISTRY[mc.architecture](mc, self.tp, ops)
        finally:
            torch.set_default_dtype(previous)
        if self.cfg.load_format == "dummy":
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        elif self.cfg.load_format == "safetensors":
            load_weights(model, self.cfg.model_path)
        else:
            raise ValueError(f"load_format: unknown {self.cfg.load_format!r}")
        return model.eval()

    def _pool_size(self, mc: ModelConfig, kv_heads: int, dtype: torch.dtype) -> int:
        if self.cfg.max_total_tokens is not None:
            if self.cfg.max_total_tokens < self.cfg.page_size:
                raise ValueError("max_total_tokens: must hold at least one page")
            return self.cfg.max_total_tokens
        per_token = KVCache.bytes_per_token(mc.num_layers, kv_heads, mc.head_dim, dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.cfg.mem_fraction_static - used
            if budget < per_token * 1024:
                raise ValueError(f"mem_fraction_static: {self.cfg.mem_fraction_static} leaves "
                                 f"{budget / 2**30:.2f} GiB for the KV pool; too little")
            return int(budget // per_token)
        return min(CPU_KV_BUDGET_BYTES // per_token, MAX_DEFAULT_TOKENS)

    # ------------------------------------------------------------------------------------------
    def submit(self, batch: ForwardBatch) -> Future:
        """Overlap scheduling in one process: run ``forward`` on the runner's own thread (torch
        releases the GIL while it computes) and return at once; batches run in order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="radixray-forward")
        return self._executor.submit(self.forward, batch)

    def result(self, handle: Future) -> ForwardOutput:
        return handle.result()

    def close(self) -> None:
        """End the forward thread ``submit`` started (after the batches it holds)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run the batch's tier copies (hierarchical cache; their outcome, agreed over the TP
        group, goes in the output), then the model over its requests, if it has any."""
        copies = batch.kv_store is not None or batch.kv_load is not None
        if copies:
            if self.host_pool is None:
                raise RuntimeError("a batch carries KV tier copies but this runner has no "
                                   "host pool (scheduler/runner configuration mismatch)")
            copies_ok = self.host_pool.run_copies(self.kv, batch)  # before the graph path too
        if batch.batch_size == 0:  # copies only
            out = ForwardOutput(next_token_ids=torch.empty(0, dtype=torch.int64))
        elif self.graphs is not None and self.graphs.can_run(batch):
            out = self.graphs.forward(batch)
        else:
            out = self._forward(batch)
        if copies:
            out.kv_store_ok, out.kv_load_ok = self._agree(*copies_ok)
        return out

    def _agree(self, stores_ok: bool, loads_ok: bool) -> tuple[bool, bool]:
        """Every rank copied its own KV shard; a copy failed if it failed on any rank. One
        small all-reduce, only in batches with copies (every rank sees the same batch, so the
        collectives line up), after the forward, so it does not delay the forward's launch."""
        if self.tp.size == 1:
            return stores_ok, loads_ok
        failed = torch.tensor([not stores_ok, not loads_ok], dtype=torch.int32,
                              device=self.device)
        self.tp.all_reduce(failed)
        return tuple(bool(f == 0) for f in failed.tolist())

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        """The model over the batch's requests (eager): slots, forward, logits, sampling."""
        input_ids = self.resolve_input_ids(batch.input_ids)
        meta = self._prepare_slots(batch)
        self.attn.prepare(meta, self.kv)
        hidden = self.model(input_ids, self._to_device(batch.positions), self.attn)  # [T, H]
        last = torch.cumsum(batch.extend_lens, 0) - 1  # index of each request's last new token
        logits = self.model.logits(hidden[self._to_device(last)])  # [B, V]
        out = self.sampler(logits, batch)
        # Every rank samples from the same gathered logits with the same generator state, so
        # every rank's buffer holds the same tokens.
        self.mark_sampled(batch.req_pool_indices, out.next_token_ids)
        if batch.input_logprob_starts is not None and bool((batch.input_logprob_starts >= 0).any()):
            out.input_token_logprobs, out.input_top_logprobs = self._input_logprobs(
                batch, hidden, input_ids)
        return out

    def resolve_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Host ids -> device ids with future references (-row) replaced by the token sampled
        for that row last step (see ``future_tokens``); ``input_ids`` is left as it is."""
        if not bool((input_ids < 0).any()):
            return self._to_device(input_ids)
        self.check_future_refs(input_ids)
        return self.resolve_on_device(self._to_device(input_ids.clone()))

    def check_future_refs(self, input_ids: torch.Tensor) -> None:
        """Raise if a future reference names a row with no sampled token yet. Reads the host
        mirror ``future_ready``, so it never waits for the device."""
        refs = -input_ids[input_ids < 0]
        if refs.numel() and not bool(self.future_ready[refs].all()):
            raise RuntimeError("future token read before it was written (scheduler bug)")

    def resolve_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Resolve the future references of device tensor ``ids`` in place (no host sync, so a
        step can be queued while the previous one runs); returns ``ids``."""
        sampled = self.future_tokens[ids.neg().clamp_(min=0)]
        return ids.copy_(torch.where(ids < 0, sampled, ids))

    def mark_sampled(self, rows: torch.Tensor, next_ids: torch.Tensor,
                     device_rows: torch.Tensor | None = None) -> None:
        """Record the tokens just sampled for table ``rows`` (host tensor; ``device_rows``, the
        same on the device, spares a blocking copy) for later steps."""
        self.future_tokens[self._to_device(rows) if device_rows is None else device_rows] = \
            next_ids
        self.future_ready[rows] = True

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return to_device(host, self.device)  # never waits for the queued forward

    def _prepare_slots(self, batch: ForwardBatch) -> AttentionMetadata:
        table, to_device = self.kv.req_to_token, self._to_device
        rows = to_device(batch.req_pool_indices)
        prefix_lens, extend_lens = batch.prefix_lens.tolist(), batch.extend_lens.tolist()
        carried = batch.prefix_slot_lens.tolist()
        prefix_slots = to_device(batch.prefix_slots)
        out_loc = to_device(batch.out_cache_loc)
        device_prefix_lens = to_device(batch.prefix_lens)
        decode_only = all(e == 1 for e in extend_lens) and not any(carried)
        if decode_only:  # one vectorised write: each row gains its new token's slot
            table[rows, device_prefix_lens] = out_loc
        p_off = o_off = 0
        for i, row in enumerate(batch.req_pool_indices.tolist() if not decode_only else []):
            if prefix_lens[i] == 0:
                # a row's new owner has sampled nothing yet (a carried prefix is not a new
                # owner: a decoding request's row is carried again when the tree dedups it)
                self.future_tokens[row] = -1
                self.future_ready[row] = False
            if carried[i]:
                table[row, : carried[i]] = prefix_slots[p_off : p_off + carried[i]]
                p_off += carried[i]
            table[row, prefix_lens[i] : prefix_lens[i] + extend_lens[i]] = \
                out_loc[o_off : o_off + extend_lens[i]]
            o_off += extend_lens[i]
        return AttentionMetadata(
            req_rows=rows, prefix_lens=device_prefix_lens,
            extend_lens=to_device(batch.extend_lens), out_cache_loc=out_loc,
            prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens,
            decode_only=decode_only)

    def _input_logprobs(self, batch: ForwardBatch, hidden: torch.Tensor, input_ids: torch.Tensor):
        """Per request: the logprobs of its prompt tokens from its logprob start on ([N], None
        when it asked for none) and, when it asked for ``top_logprobs_num`` k > 0, the k best
        at each of those positions (values [N, k], ids [N, k]; else None). A chunk that stops
        inside the prompt also scores the token after it (``batch.next_prompt_ids``) with its
        last position's logits: the next chunk starts past them."""
        tokens: list[torch.Tensor | None] = []
        tops: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        ks = (batch.top_logprobs_num.tolist() if batch.top_logprobs_num is not None
              else [0] * batch.batch_size)
        next_ids = (batch.next_prompt_ids.tolist() if batch.next_prompt_ids is not None
                    else [-1] * batch.batch_size)
        offset = 0
        for start, extend, k, next_id in zip(batch.input_logprob_starts.tolist(),
                                             batch.extend_lens.tolist(), ks, next_ids):
            # position p predicts token p + 1; the last position predicts the next chunk's
            # first token when there is one, else nothing known here
            end = extend if next_id >= 0 else extend - 1
            if start < 0:
                tokens.append(None)
                tops.append(None)
            elif start >= end:  # nothing to score in this chunk (no empty collectives)
                tokens.append(torch.empty(0))
                tops.append((torch.empty(0, k), torch.empty(0, k, dtype=torch.int64))
                            if k > 0 else None)
            else:
                logits = self.model.logits(hidden[offset + start : offset + end])
                targets = input_ids[offset + start + 1 : offset + extend]
                if next_id >= 0:
                    targets = torch.cat([targets, self._to_device(torch.tensor([next_id]))])
                tokens.append(token_logprobs(logits, targets).cpu())
                tops.append(tuple(t.cpu() for t in top_logprobs(logits, k)) if k > 0 else None)
            offset += extend
        return tokens, tops
