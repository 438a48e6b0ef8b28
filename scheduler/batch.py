"""ScheduleBatch: the requests of one forward step, and the ForwardBatch sent to the worker.

A batch is ``prefill`` requests (a prompt, a chunk of one, or a retracted request coming back)
followed by ``decode`` requests (one new token each). A batch with both is a mixed-chunk batch.
Every request computes ``tokens[cached_len:seq_len]``; ``ForwardBatch`` carries the same
lengths (``prefix_lens = cached_len``).

Slot rule of the worker protocol: a prefill request carries its whole prefix's slots (its row
was just built or changed), a decode request carries none (the worker's mirror already has
them) unless its row changed since (``Req.resend_prefix``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..worker.forward_batch import ForwardBatch
from .cache_manager import CacheManager
from .request import Req


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass
class ScheduleBatch:
    prefill: list[Req]
    decode: list[Req]
    forward_batch: ForwardBatch
    # Per prefill request: where its input logprobs start in this step's extend tokens
    # (-1: none); process_output needs the same numbers the worker got.
    input_logprob_starts: list[int]
    # Per request, cached_len before and after this step (set by Scheduler.advance when the
    # batch is submitted; results may be processed a step later, under overlap scheduling).
    start_lens: list[int] | None = None
    seq_lens: list[int] | None = None
    # Hierarchical cache: the ticket of the tier copies the forward batch carries (settled
    # from the output by Scheduler.process_output), or None.
    copies: object | None = None

    @property
    def reqs(self) -> list[Req]:
        return self.prefill + self.decode

    @property
    def mode(self) -> ForwardMode:
        if not self.decode:
            return ForwardMode.EXTEND
        return ForwardMode.MIXED if self.prefill else ForwardMode.DECODE

    @classmethod
    def build(cls, prefill: list[Req], decode: list[Req], cache: CacheManager) -> "ScheduleBatch":
        """Allocate the step's slots (``extend_len`` is already set on prefill requests) and
        describe the step for the worker. Mutates the requests' rows and ``extend_len``, and
        the cache (allocation, maybe eviction)."""
        for r in decode:
            r.extend_len = 1
        reqs = prefill + decode
        out_cache_loc = cache.alloc_extend(reqs)
        starts = [_input_logprob_start(r) for r in prefill]
        next_ids = [_next_prompt_id(r, s) for r, s in zip(prefill, starts)]
        fb = _forward_batch(prefill, decode, cache, out_cache_loc, starts, next_ids)
        # hierarchical cache: tier copies decided up to now (this batch's evictions and
        # loads included) run on the worker before this batch's forward
        fb.kv_store, fb.kv_load, copies = cache.take_kv_copies()
        return cls(prefill, decode, fb, starts, copies=copies)

    @classmethod
    def copies_only(cls, cache: CacheManager) -> "ScheduleBatch":
        """A batch of no requests that carries the queued tier copies: what a step sends
        when requests wait for a load and nothing else runs. Mutates the copy queue."""
        empty = torch.empty(0, dtype=torch.int64)
        fb = ForwardBatch(input_ids=empty, positions=empty, req_pool_indices=empty,
                          prefix_lens=empty, extend_lens=empty, out_cache_loc=empty,
                          prefix_slots=empty, prefix_slot_lens=empty, sampling_params=[],
                          output_lens=empty)
        fb.kv_store, fb.kv_load, copies = cache.take_kv_copies()
        return cls([], [], fb, [], copies=copies)


def _input_logprob_start(req: Req) -> int:
    """Index among this step's extend tokens where input logprobs start, or -1.

    A chunk after the first starts at 0: its first token was scored by the chunk before,
    whose last logits predict it (see ``_next_prompt_id``)."""
    if not req.input_logprobs_pending or req.seq_len <= req.logprob_start_len:
        return -1
    return max(req.logprob_start_len - req.cached_len, 0)


def _next_prompt_id(req: Req, start: int) -> int:
    """The prompt token after this step's extend when the step computes input logprobs and
    stops inside the prompt (a chunk), else -1. Only this step has the logits that predict
    it; without it the next chunk's first entry would be a null (a seam)."""
    if start < 0 or req.seq_len >= req.prompt_len:
        return -1
    return req.origin_input_ids[req.seq_len]


def decode_input_ids(decode: list[Req]) -> list[int]:
    """The token each decode request feeds: the one at position ``cached_len``.

    Under overlap scheduling that token may not be known yet (batch N, which samples it, is
    still running while batch N+1 is built): then the id is a future reference ``-row``
    (``req_pool_idx`` >= 1), which the worker resolves from its per-row buffer of the tokens
    it sampled last."""
    return [r.tokens(r.cached_len, r.cached_len + 1)[0] if r.cached_len < r.total_len
            else -r.req_pool_idx for r in decode]


def _forward_batch(prefill: list[Req], decode: list[Req], cache: CacheManager,
                   out_cache_loc: torch.Tensor, starts: list[int],
                   next_ids: list[int]) -> ForwardBatch:
    reqs = prefill + decode
    input_ids: list[int] = []
    for r in prefill:
        input_ids += r.tokens(r.cached_len, r.seq_len)
    input_ids += decode_input_ids(decode)
    prefix_lens = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
    extend_lens = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
    if prefill:
        positions = torch.cat([torch.arange(r.cached_len, r.seq_len) for r in reqs])
    else:
        positions = prefix_lens.clone()

    carried, carried_lens = [], []
    for i, r in enumerate(reqs):
        carry = (i < len(prefill) or r.resend_prefix) and r.cached_len > 0
        r.resend_prefix = False
        carried_lens.append(r.cached_len if carry else 0)
        if carry:
            carried.append(cache.rows.read(r.req_pool_idx, r.cached_len))
    prefix_slots = torch.cat(carried) if carried else torch.empty(0, dtype=torch.int64)

    params = [r.sampling_params for r in reqs]
    any_logprob = any(r.return_logprob for r in reqs)
    any_input_logprobs = any(s >= 0 for s in starts)
    no_more = [-1] * len(decode)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        out_cache_loc=out_cache_loc,
        prefix_slots=prefix_slots,
        prefix_slot_lens=torch.tensor(carried_lens, dtype=torch.int64),
        sampling_params=params,
        penalty_history=[(r.origin_input_ids, r.output_ids) if p.has_penalties else None
                         for r, p in zip(reqs, params)],
        # tokens generated before this step; counted from lengths, since under overlap the
        # newest one may still be on its way back
        output_lens=torch.tensor([max(r.seq_len - r.prompt_len, 0) for r in reqs],
                                 dtype=torch.int64),
        return_logprob=(torch.tensor([r.return_logprob for r in reqs]) if any_logprob
                        else None),
        top_logprobs_num=(torch.tensor([r.top_logprobs_num for r in reqs]) if any_logprob
                          else None),
        input_logprob_starts=(torch.tensor(starts + no_more, dtype=torch.int64)
                              if any_input_logprobs else None),
        next_prompt_ids=(torch.tensor(next_ids + no_more, dtype=torch.int64)
                         if any_input_logprobs and any(t >= 0 for t in next_ids) else None),
    )
