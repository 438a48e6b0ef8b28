"""The scheduler's core record, ``Req``, with its finish reason and per-step output.

Length vocabulary (the words ``ForwardBatch`` uses, per request). ``tokens`` is the prompt
followed by the generated tokens; ``total_len = len(tokens)``.

- ``cached_len``  tokens whose K/V sit in slots: row ``req_pool_idx`` of the request-to-token
  table holds their slots in ``[0, cached_len)``. They are the next forward's prefix.
- ``extend_len``  tokens the batch being scheduled computes: ``tokens[cached_len:seq_len]``
  (a whole prompt, a chunk of one, or the last generated token in a decode step).
- ``seq_len = cached_len + extend_len``.
- ``prefix_indices`` / ``tree_len``  the leading ``tree_len`` of those slots belong to the radix
  tree (this request holds a lock on ``last_node`` so they stay); the slots in
  ``[tree_len, cached_len)`` belong to this request alone and are freed or inserted by it.

A forward that reaches ``total_len`` samples a real next token; one that stops short of it
(a chunk of a long prompt) throws its sample away.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from ..worker.sampling_params import SamplingParams
from .radix_key import RadixKey

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
_arrival_counter = itertools.count()

LogprobEntry = tuple  # (logprob or None, token id)


def prompt_fit_problem(prompt_len: int, context_len: int, pool_size: int | None,
                       field: str) -> str | None:
    """Why a prompt can never run (it alone fills the context, or the KV cache with room for
    one new token), worded with the caller's ``field``; None if it fits. The scheduler, the
    HTTP checks and the Engine all ask this, each naming the field its caller wrote."""
    if prompt_len >= context_len:
        return (f"{field}: the prompt has {prompt_len} tokens; the model's context length is "
                f"{context_len}")
    if pool_size is not None and prompt_len + 1 > pool_size:
        return f"{field}: the prompt has {prompt_len} tokens; the KV cache holds {pool_size}"
    return None


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended; ``to_dict`` gives SGLang's wire form."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # stop: the token id or stop string that matched
    length: int | None = None  # length: the number of generated tokens
    message: str | None = None  # abort: what went wrong
    status_code: int | None = None  # abort: the HTTP status it means (400: the client's input)

    @classmethod
    def stop(cls, matched: int | str) -> "FinishReason":
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, length: int) -> "FinishReason":
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str, status_code: int | None = None) -> "FinishReason":
        return cls("abort", message=message, status_code=status_code)

    def to_dict(self) -> dict:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        out = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


class Req:
    """One generation request: what was asked, what was generated, and where its KV lives."""

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams | None = None,
                 *, return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, priority: int | None = None,
                 routing_key: str | None = None, extra_key: str | None = None,
                 probe: bool = False):
        if not isinstance(rid, str) or not rid:
            raise ValueError("rid: must be a non-empty string")
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError("input_ids: must be a non-empty list of token ids")
        # type() is int: exact ints only (bool is an int subclass); min() after, once
        if not all(type(t) is int for t in input_ids) or min(input_ids) < 0:
            raise ValueError("input_ids: token ids must be non-negative integers")
        if not isinstance(logprob_start_len, int) or not -1 <= logprob_start_len < len(input_ids):
            raise ValueError(f"logprob_start_len: must be -1 or in [0, {len(input_ids)}) "
                             f"for a {len(input_ids)}-token prompt")
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num: must be a non-negative integer")
        # checked here, not where the scheduler first uses them (ordering, the radix key):
        # there a bad value would fail a step and every request in it
        if priority is not None and type(priority) is not int:
            raise ValueError("priority: must be an integer")
        for name, value in (("routing_key", routing_key), ("extra_key", extra_key)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: must be a string")
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.return_logprob = bool(return_logprob)
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.priority = priority
        self.routing_key = routing_key
        self.extra_key = extra_key
        self.probe = probe  # a health check: served as any request, kept out of the counters
        self.arrival = next(_arrival_counter)  # FCFS order, kept across retractions
        # Seconds from submission until a prefill batch first took the request (its first
        # chunk, not its first token): the queue time the metrics report. None while it waits.
        self.submitted_at = time.perf_counter()
        self.queue_time: float | None = None

        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.to_abort: str | None = None  # abort asked; acted on when no batch holds the req
        # Constrained decoding: the GrammarState over output_ids (see constrained.py), set
        # once the grammar has compiled; None for a free request.
        self.grammar = None

        # KV state (see the module docstring)
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = EMPTY_SLOTS
        self.last_node = None
        self.cached_len = 0
        self.extend_len = 0
        # Set when the row changed under the worker's mirror of it (see CacheManager.
        # cache_unfinished): the next batch carries the whole prefix, even for a decode step.
        self.resend_prefix = False
        # Hierarchical cache: host-only nodes continuing the matched prefix (set by match),
        # the load this request waits for (a hicache_copies.LoadJob, while it waits), the
        # positions [start, end) that load brought back, and how many tokens of the matched
        # prefix came from the host (set by match).
        self.host_nodes: list = []
        self.load = None
        self.load_range: tuple[int, int] | None = None
        self.loaded_len = 0
        self._match_key: RadixKey | None = None  # see match_key

        # Accounting: prompt tokens served from the cache that this request had not computed
        # itself (SGLang's cached_tokens), and how many tokens it has computed so far.
        self.cached_tokens = 0
        self.host_cached_tokens = 0  # of cached_tokens, those loaded from the host tier
        self.computed_len = 0
        self.num_retractions = 0

        # Logprobs, filled as steps come back. Input logprobs are collected over the prefill
        # (possibly several chunks) and emitted once.
        self.input_logprobs_pending = self.return_logprob and logprob_start_len >= 0
        self.input_token_logprobs: list[LogprobEntry] = []
        self.input_top_logprobs: list[list[LogprobEntry] | None] = []

    # ------------------------------------------------------------------ lengths
    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def total_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def known_cached_len(self) -> int:
        """Cached tokens whose ids are known here. Under overlap scheduling ``cached_len`` can
        run one past ``total_len``: a step was submitted whose input token is still on its way
        back (or never comes, for a request that finished meanwhile)."""
        return min(self.cached_len, self.total_len)

    @property
    def seq_len(self) -> int:
        return self.cached_len + self.extend_len

    @property
    def tree_len(self) -> int:
        return len(self.prefix_indices)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """``(prompt + output)[start:end]`` without building the whole sequence."""
        p = len(self.origin_input_ids)
        if end <= p:
            return self.origin_input_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.origin_input_ids[start:] + self.output_ids[: end - p]

    def match_key(self) -> RadixKey:
        """The radix key a cache match of this waiting request looks up: its first
        ``max_prefix_len()`` tokens. Built once while it waits (lpm and dfs-weight match the
        whole queue every round; packing an 8k-token prompt each time was most of their cost);
        ``reset_kv_state`` (a retraction: the sequence has grown) drops it."""
        length = self.max_prefix_len()
        if self._match_key is None or len(self._match_key) != length:
            self._match_key = RadixKey(self.tokens(0, length), self.extra_key)
        return self._match_key

    def max_prefix_len(self) -> int:
        """How much of the sequence a cache match may cover.

        The last token is always recomputed so the forward has logits to sample from; with
        input logprobs still owed, everything from ``logprob_start_len`` on is recomputed too.
        """
        limit = self.total_len - 1
        if self.input_logprobs_pending:
            limit = min(limit, self.logprob_start_len)
        return limit

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def count_prompt_hits(self) -> None:
        """At admission (the prefix matched): add to ``cached_tokens`` the prompt tokens the
        matched prefix serves that this request had not computed itself (a retracted request
        re-matching its own tokens gains nothing). Only the prompt counts, as in OpenAI's
        usage: a grammar's forced opening (jump-forward) is output that may already be in the
        tree. The host-loaded part of the match is its last part."""
        p = self.prompt_len
        start, end = min(self.computed_len, p), min(self.tree_len, p)
        gained = max(end - start, 0)
        self.cached_tokens += gained
        loaded = max(end - max(start, self.tree_len - self.loaded_len), 0)
        self.host_cached_tokens += min(gained, loaded)

    def reset_kv_state(self) -> None:
        """Forget every slot (after retraction or release); the caller has freed them."""
        self.req_pool_idx = None
        self.prefix_indices = EMPTY_SLOTS
        self.last_node = None
        self.cached_len = 0
        self.extend_len = 0
        self.resend_prefix = False
        self.host_nodes = []
        self.load_range = None
        self.loaded_len = 0
        self._match_key = None

    def __repr__(self) -> str:
        return (f"Req({self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
                f"cached={self.cached_len}, tree={self.tree_len}, extend={self.extend_len})")


@dataclass
class RequestOutput:
    """What one step produced for one request; the Engine and the server build on these."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    host_cached_tokens: int = 0  # of cached_tokens, those loaded from the host tier
    queue_time: float | None = None  # see Req.queue_time
    # New entries this step (only with return_logprob): (logprob, token id).
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    # The whole input-logprob list, once, in the step that finishes the prompt's prefill.
    # The first entry's logprob is None (the token at logprob_start_len has no logits).
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
