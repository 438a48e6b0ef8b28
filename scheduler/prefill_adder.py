"""PrefillAdder: which waiting requests join the next prefill batch, under three budgets.

- ``rem_total_tokens``: KV slots. Free slots plus evictable cache, minus what requests already
  admitted will still need: each running request reserves ``min(remaining max_new_tokens,
  4096) x new_token_ratio`` (most stop early), each request admitted this round its extend
  tokens plus its clipped ``max_new_tokens`` in full. Read live, because locking a matched
  prefix takes it out of the evictable cache.
- ``rem_input_tokens``: ``--max-prefill-tokens`` per batch (the first request may exceed it).
- ``rem_chunk_tokens``: ``--chunked-prefill-size`` per batch; a prompt longer than what is left
  is cut, and the rest continues first in the next round (the "chunked request").

The adder only decides and locks; slots are allocated for the whole batch afterwards, so the
budget must already count everything the batch will take.
"""

from __future__ import annotations

import time
from enum import Enum

from .cache_manager import CacheManager
from .request import Req
from .token_ratio import CLIP_MAX_NEW_TOKENS


class AddResult(Enum):
    CONTINUE = "continue"  # room for more
    NO_TOKEN = "no_token"  # out of KV slots: stop this round
    OTHER = "other"  # out of prefill or chunk budget: stop this round


class PrefillAdder:
    def __init__(self, cache: CacheManager, running: list[Req], new_token_ratio: float,
                 chunk_size: int | None, max_prefill_tokens: int, mixed_decode_tokens: int = 0,
                 has_chunked_req: bool = False):
        """``mixed_decode_tokens``: slots the running decodes take when they ride along in this
        batch (mixed chunk). ``has_chunked_req``: a prompt is mid-chunk and holds memory."""
        self.cache = cache
        self.page_size = cache.page_size
        self.reserved = float(mixed_decode_tokens) + sum(
            min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * new_token_ratio
            for r in running)
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = None if chunk_size is None else chunk_size - mixed_decode_tokens
        # Nothing else holds or will claim memory: a request is then admitted as long as its
        # prompt fits, whatever its output needs; otherwise a request whose prompt +
        # max_new_tokens exceeds what is free would wait forever. Retraction handles running
        # out later. Its output is reserved all the same against the requests after it.
        self.alone = not running and not has_chunked_req
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> float:
        return self.cache.available_and_evictable() - self.reserved

    def _page_ceil(self, n: int) -> int:
        p = self.page_size
        return -(-n // p) * p

    def _admit(self, req: Req, extend_len: int, reserve: int) -> None:
        req.extend_len = extend_len
        if req.queue_time is None:
            req.queue_time = time.perf_counter() - req.submitted_at
        self.can_run.append(req)
        self.reserved += self._page_ceil(extend_len) + reserve
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len

    def budget_state(self) -> AddResult:
        if self.rem_total_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None
                                          and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def add_chunked_req(self, req: Req) -> Req | None:
        """Give the mid-chunk request its next piece (as much as the chunk and KV budgets
        allow; nothing when they allow nothing). Returns the request while more remains."""
        left = req.total_len - req.cached_len
        room = int(self.rem_total_tokens)
        if self.rem_chunk_tokens is not None:
            room = min(room, self.rem_chunk_tokens)
        room -= room % self.page_size
        if room <= 0:
            return req
        take = min(left, room)
        last_piece = take == left
        reserve = min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) if last_piece else 0
        self._admit(req, take, reserve)
        return None if last_piece else req

    def _need(self, req: Req) -> tuple[int, int]:
        """(free slots ``req`` needs to be admitted, the output reserve it then takes). A
        request alone needs only its prompt to fit; its output is still reserved once it is
        in, against the requests after it (they over-committed by its max_new_tokens)."""
        reserve = min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)
        alone = self.alone and not self.can_run
        return self._page_ceil(req.total_len - req.tree_len) + (0 if alone else reserve), reserve

    def load_budget(self, req: Req) -> float:
        """Slots a host-tier load of ``req``'s prefix may lock so that ``req`` still passes
        ``add_one_req`` afterwards (the loaded prefix is no longer to compute): a load never
        takes memory from requests admitted this round or holds it for one that cannot run."""
        host = sum(len(n.key) for n in req.host_nodes)
        return self.rem_total_tokens - (self._need(req)[0] - host)

    def add_one_req(self, req: Req) -> AddResult:
        """Try to admit a matched (``prefix_indices``/``last_node`` set), slot-less request.

        On success ``req.extend_len`` is set, its prefix is locked and it is in ``can_run``
        (cut to a chunk if the chunk budget is short; then it is ``new_chunked_req``). The
        result says whether more requests may follow."""
        alone = self.alone and not self.can_run
        extend = req.total_len - req.tree_len
        need, reserve = self._need(req)

        def out_of_slots() -> bool:
            return need > self.rem_total_tokens if alone else need >= self.rem_total_tokens

        if out_of_slots():
            return AddResult.NO_TOKEN
        if extend > self.rem_input_tokens and self.can_run:
            return AddResult.OTHER
        self.cache.lock(req)  # (host-tier tokens not loaded by now are computed: extend stays)
        if out_of_slots():  # locking took the prefix out of the evictable budget
            self.cache.unlock(req)
            return AddResult.NO_TOKEN
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            self._admit(req, extend, reserve)
        else:
            piece = self.rem_chunk_tokens - self.rem_chunk_tokens % self.page_size
            if piece <= 0:
                self.cache.unlock(req)
                return AddResult.OTHER
            self._admit(req, piece, 0)
            self.new_chunked_req = req
        return self.budget_state()
