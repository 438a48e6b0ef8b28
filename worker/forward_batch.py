"""The plain batch description the scheduler hands to a worker, and what comes back.

Length vocabulary (per request ``i``, the same words the scheduler uses):
- ``prefix_lens[i]``  tokens whose K/V already sit in slots (cached prefix, earlier chunks,
  earlier decode steps): the worker does not recompute them.
- ``extend_lens[i]``  tokens computed in this step (the prompt's uncached part, a chunk, or 1
  for a decode step). ``seq_len = prefix_len + extend_len``.

Slots: the worker keeps its own mirror of the request-to-token table. Rule: a request whose
``prefix_slot_lens[i] > 0`` carries its whole prefix's slots (in ``prefix_slots``) and the worker
writes them to row ``req_pool_indices[i]`` before the forward; every request carries the slots
of its new tokens in ``out_cache_loc``. Decode requests carry no prefix slots: the worker wrote
them in earlier steps. Everything here is CPU tensors and plain Python, so it pickles cheaply
across Ray.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64; negative = future reference (overlap scheduling)
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64, rows of the request-to-token table
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64; sum == T
    out_cache_loc: torch.Tensor  # [T] int64, slot for each new token's K/V
    prefix_slots: torch.Tensor  # [sum(prefix_slot_lens)] int64
    prefix_slot_lens: torch.Tensor  # [B] int64, 0 or prefix_lens[i]
    sampling_params: list[SamplingParams]  # [B]
    # Token history for penalties, only for requests with penalties on (else None):
    # (prompt ids, output ids so far).
    penalty_history: list[tuple[list[int], list[int]] | None] = field(default_factory=list)
    # How many tokens each request has generated before this step (min_new_tokens, seeds).
    output_lens: torch.Tensor | None = None  # [B] int64
    # Logprobs: per request, return the chosen token's logprob and this many top logprobs
    # (-1: none); input logprobs from extend-token index ``input_logprob_starts[i]`` on
    # (-1: none).
    return_logprob: torch.Tensor | None = None  # [B] bool
    top_logprobs_num: torch.Tensor | None = None  # [B] int64
    input_logprob_starts: torch.Tensor | None = None  # [B] int64
    # For a request with input logprobs whose extend stops inside its prompt (a chunk of a
    # chunked prefill): the prompt token right after the chunk, scored with the chunk's last
    # logits, which the next chunk no longer has (-1: none). Set only with input_logprob_starts.
    next_prompt_ids: torch.Tensor | None = None  # [B] int64
    # Token bitmask from grammars, [B, ceil(V/32)] int32, or None when no request is constrained.
    vocab_mask: torch.Tensor | None = None
    # Hierarchical cache: KV copies the worker runs before the forward, stores first (this
    # batch may reuse the device slots they read), then loads. (device slots, host slots) to
    # copy device -> host, and (host slots, device slots) to copy host -> device; int64. A
    # batch may carry copies and no request (batch_size 0): it computes nothing.
    kv_store: tuple[torch.Tensor, torch.Tensor] | None = None
    kv_load: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return bool((self.extend_lens == 1).all()) and int(self.prefix_slot_lens.sum()) == 0


@dataclass
class ForwardOutput:
    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: torch.Tensor | None = None  # [B] float32
    # per request: (top logprobs [k], their token ids [k]) or None
    top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # per request with input_logprob_starts[i] = s >= 0: for extend-token indices j in
    # [s, extend_len - 1), the logprob of extend token j + 1 under the logits at j; that is
    # extend_len - 1 - s values, plus one last value, the logprob of next_prompt_ids[i] under
    # the logits at extend_len - 1, when that id is >= 0. The token at s itself has no value
    # (its logits were not computed here), which is why SGLang's contract puts a null first;
    # a later chunk's first token got its value from the chunk before (next_prompt_ids).
    input_token_logprobs: list[torch.Tensor | None] | None = None
    input_top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # Hierarchical cache: whether the batch's kv_store / kv_load copies succeeded on every
    # rank (True when it carried none). A copy that fails is reported here, never raised.
    kv_store_ok: bool = True
    kv_load_ok: bool = True

    def start_host_copy(self):
        """Start copying the sampled tokens and their logprobs to the CPU, without waiting;
        returns ``finish()``, which waits for that copy alone and returns this output with CPU
        tensors. A CUDA tensor unpickles only where CUDA is (the scheduler's actor has none),
        and a step that is not waited for lets the next one be queued meanwhile. The other
        fields are CPU tensors already; CPU outputs finish at once."""
        on_gpu = [name for name in ("next_token_ids", "next_token_logprobs")
                  if getattr(self, name) is not None and getattr(self, name).is_cuda]
        if not on_gpu:
            return lambda: self
        copies = {}
        for name in on_gpu:
            t = getattr(self, name)
            copies[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copies[name].copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def finish() -> "ForwardOutput":
            copied.synchronize()
            for name, host in copies.items():
                setattr(self, name, host)
            return self

        return finish


# ------------------------------------------------------------------ one-tensor wire format
# Tensor parallelism sends every batch from rank 0 to its peers once per step. Pickling torch
# tensors is what makes ``pickle.dumps(batch)`` slow (each one goes through torch's storage
# machinery), so ``pack_batch`` pickles the batch with every tensor swapped for a small
# reference (dtype, shape, byte offset) and appends the tensors' raw bytes after the pickle.
# The swap happens by type, anywhere in the object graph (a tuple of tensors, a future field),
# so no field is named here. Layout, all in one uint8 tensor:
#   [pickle length: 8 bytes][pickle][zero padding to 8][tensor bytes, each 8-aligned]

_ALIGN = 8


def _tensor_ref(offset: int, nbytes: int, dtype: str, shape: tuple) -> torch.Tensor:
    """Stands in for a tensor inside the pickle; ``unpack_batch`` resolves it (see _Unpickler)."""
    raise RuntimeError("a packed batch must be read with unpack_batch, not pickle.loads")


class _Unpickler(pickle.Unpickler):
    def __init__(self, header: bytes, data: torch.Tensor):
        super().__init__(io.BytesIO(header))
        self.data = data

    def find_class(self, module: str, name: str):
        if module == __name__ and name == "_tensor_ref":
            return self.tensor_at
        return super().find_class(module, name)

    def tensor_at(self, offset: int, nbytes: int, dtype: str, shape: tuple) -> torch.Tensor:
        # offsets are 8-aligned within ``data`` (a fresh copy), so any dtype can view them
        return self.data[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)


def pack_batch(batch: ForwardBatch) -> torch.Tensor:
    """Serialise ``batch`` into one CPU uint8 tensor (``unpack_batch`` inverts it exactly).

    Tensors come back on the CPU, contiguous, with their dtype and shape. Mutates nothing."""
    chunks: list[torch.Tensor] = []
    size = 0

    def reduce_tensor(t: torch.Tensor):
        nonlocal size
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        ref = (size, raw.numel(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
        chunks.append(raw)
        size += raw.numel()
        pad = -size % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
            size += pad
        return _tensor_ref, ref

    buf = io.BytesIO()
    buf.write(bytes(8))
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {torch.Tensor: reduce_tensor}  # by exact type, checked in C
    pickler.dump(batch)
    header_len = buf.tell() - 8
    buf.write(bytes(-buf.tell() % _ALIGN))
    buf.seek(0)
    buf.write(header_len.to_bytes(8, "little"))
    head = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    return torch.cat([head, *chunks]) if chunks else head


def unpack_batch(packed: torch.Tensor) -> ForwardBatch:
    """Rebuild the batch ``pack_batch`` serialised. ``packed`` (uint8, any device) is only read;
    every tensor in the result is a fresh CPU tensor."""
    packed = packed.to("cpu")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() < 8:
        raise ValueError("packed: must be a 1-D uint8 tensor made by pack_batch")
    header_len = int.from_bytes(packed[:8].numpy().tobytes(), "little")
    start = 8 + header_len + (-(8 + header_len) % _ALIGN)
    if start > packed.numel():
        raise ValueError(f"packed: header says {header_len} pickle bytes, "
                         f"tensor holds {packed.numel()}")
    header = packed[8:8 + header_len].numpy().tobytes()
    # one copy for all tensors: the result must not alias ``packed`` (a reused receive buffer)
    return _Unpickler(header, packed[start:].clone()).load()
