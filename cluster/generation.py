"""One request's life as the HTTP layer sees it: submit, stream, detokenize, account.

Both APIs (OpenAI and SGLang-native) build ``GenerateRequest``s, then call ``run_request`` (or
``run_many`` for several at once), which reads the engine's ``TokenOutput`` stream, feeds the
detokenizer, gathers logprobs and timings into a ``RequestState`` and yields it after every
output. Breaking out of the loop closes the engine stream, which aborts the request and frees
its KV; that is how stop strings and client disconnects end a generation early.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..router.disconnect import until_disconnect as await_unless_disconnected
from ..scheduler.stop import StopRegexTooSlow
from .api_errors import APIError, bad_request, unavailable
from .detokenizer import IncrementalDetokenizer
from .engine_protocol import EngineClient, GenerateRequest, TokenOutput
from .request_checks import check_batch_size


# Request bodies from this size on are validated and tokenized in a worker thread. Tokenizing
# a megabyte of text takes seconds (2.5 s for 2 MB on these CPUs), and on the event loop no
# other request on the replica would be served meanwhile; the tokenizer releases the GIL while
# it encodes. Below it, the thread hop would cost more than the tokenizing.
LARGE_BODY_BYTES = 64 << 10


# A body naming a grammar (or tools, whose schemas become one) is prepared in a worker thread
# too, whatever its size: checking a grammar parses it with xgrammar, which a 70-byte JSON
# schema can keep busy for seconds (a regex ``pattern`` with a large repetition count:
# ``scheduler/grammar.py`` refuses those, but the next such shape should not freeze the
# replica's event loop either). xgrammar releases the GIL while it parses.
GRAMMAR_MARKERS = (b'"json_schema"', b'"regex"', b'"ebnf"', b'"structural_tag"',
                   b'"response_format"', b'"tools"')


async def prepare_off_loop_if_large(request, prepare, *args):
    """``prepare(*args)`` (validation and tokenization of a request), in a worker thread when
    the HTTP body is large or names a grammar, else inline. Exceptions (400s) propagate
    either way."""
    body = await request.body()  # read once already; cached
    if len(body) < LARGE_BODY_BYTES and not any(m in body for m in GRAMMAR_MARKERS):
        return prepare(*args)
    return await asyncio.to_thread(prepare, *args)


def new_rid(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class RequestState:
    """Everything known about one submitted request so far; ``delta`` is the text released by
    the latest output (what a stream sends next)."""

    req: GenerateRequest
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    delta: str = ""
    finished: bool = False
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list | None = None
    start: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    end_time: float | None = None
    queue_time: float | None = None
    itl: list[float] = field(default_factory=list)
    _last_token_time: float | None = None

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def e2e_latency(self) -> float:
        return (self.end_time or time.perf_counter()) - self.start

    def apply(self, out: TokenOutput) -> None:
        """Fold one engine output in: ids, logprobs, timings, released text and finish."""
        now = time.perf_counter()
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.host_cached_tokens = max(self.host_cached_tokens, out.host_cached_tokens)
        if out.queue_time is not None:
            self.queue_time = out.queue_time
        if out.input_token_logprobs is not None:
            self.input_token_logprobs = list(out.input_token_logprobs)
            self.input_top_logprobs = list(out.input_top_logprobs or [])
        new = list(out.new_token_ids)
        # Text a grammar forces at the start goes out before the prompt is computed (its
        # output has no queue_time yet): the first token, for TTFT and ITL, is the first one
        # that follows the prefill.
        # (An answer the grammar forces whole never runs a prefill: its first token is its end.)
        if new and (self.first_token_time is not None or out.queue_time is not None
                    or out.finished):
            if self.first_token_time is None:
                self.first_token_time = now
            elif self._last_token_time is not None:
                self.itl.extend([(now - self._last_token_time) / len(new)] * len(new))
            self._last_token_time = now
        self.output_ids.extend(new)
        self.output_token_logprobs.extend(out.output_token_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        # A matched stop token is not part of the text (unless no_stop_trim); special stop
        # tokens vanish on decode anyway, plain ones would otherwise show.
        reason = out.finish_reason if out.finished else None
        sp = self.req.sampling_params
        if (new and reason and reason.get("type") == "stop"
                and isinstance(reason.get("matched"), int) and not sp.no_stop_trim
                and new[-1] == reason["matched"]):
            new = new[:-1]
        self.delta = self.detok.add(new)
        if self.detok.matched_stop is not None:
            self.end({"type": "stop", "matched": self.detok.matched_stop}, now)
        elif out.finished:
            self.delta += self.detok.finish()
            self.end(out.finish_reason or {"type": "abort", "message": "no finish reason"},
                         now)

    def end(self, reason: dict, now: float) -> None:
        """Mark finished with ``reason`` (SGLang's finish-reason dict) at time ``now``."""
        self.finished = True
        self.finish_reason = reason
        self.end_time = now


class ServingContext:
    """What every handler needs: the engine, the tokenizer, limits, metrics, and the registry
    of live requests (for back-pressure and /abort_request)."""

    def __init__(self, engine: EngineClient, tokenizer, model_name: str, context_len: int,
                 vocab_size: int, max_queued_requests: int | None = None, metrics=None,
                 tool_call_parser: str | None = None, pool_tokens: int | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.pool_tokens = pool_tokens  # KV slots: a prompt must fit them (None: unchecked)
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.tool_call_parser = tool_call_parser  # tool_calls.PARSERS key; None: no parsing
        self.waiting: set[str] = set()  # engine rids admitted that have no output yet
        self.live: dict[str, set[str]] = {}  # client rid -> engine rids
        self.engine_rids: set[str] = set()  # every live engine rid (the union of live's sets)
        # A batch prompt's rid -> its copies' engine rids (n > 1): abortable by that rid too
        self.prompts: dict[str, set[str]] = {}
        # Engine rids of live sessions aborted before the engine had them (n > 1 copies wait
        # for their prompt's warm-up): run_request finishes them without submitting.
        self.aborted: set[str] = set()
        self.warmups: dict[str, str] = {}  # copy rid -> rid of its prompt's running warm-up

    async def abort(self, client_rid: str | None = None, abort_all: bool = False) -> list[str]:
        """Abort a request by client rid or engine rid (or every live one); returns the engine
        rids aborted (none for a rid that is not live). Works at any stage, before submission
        included (see ``aborted``)."""
        if abort_all:
            rids = set(self.engine_rids)
        else:
            rids = self.live.get(client_rid) or self.prompts.get(client_rid) or {client_rid}
        registered = rids & self.engine_rids  # before the awaits: sessions may close meanwhile
        self.aborted.update(registered)
        warm = {self.warmups[r] for r in rids if r in self.warmups}
        for rid in sorted(rids | warm):
            await self.engine.abort(rid)
        return sorted(registered)

    def open_session(self, client_rid: str, reqs: list[GenerateRequest],
                     prompts: dict[str, set[str]] | None = None,
                     size_field: str = "n") -> "Session":
        """Admit ``reqs`` (429 when the waiting requests would exceed max_queued_requests; 400
        naming ``size_field`` when they alone do, so that no retry could help; 400 when a rid
        is already live or given twice) and register them under ``client_rid``; ``prompts``:
        a batch prompt's rid -> the engine rids of its n > 1 copies."""
        rids = [r.rid for r in reqs]
        check_batch_size(len(rids), size_field)
        limit = self.max_queued_requests
        if limit is not None and len(rids) > limit:
            raise bad_request(f"{size_field}: the request asks for {len(rids)} sequences "
                              f"(prompts x n), more than max_queued_requests ({limit}) lets "
                              "wait at once; send fewer", param=size_field)
        taken = ([r for r in rids if r in self.engine_rids]  # (a set kept, not a union per call)
                 or ([client_rid] if client_rid in self.live else []))
        if taken:
            raise bad_request(f"rid: {taken[0]!r} is already in use by a running request",
                              param="rid")
        seen: set[str] = set()  # a set: a batch of 10,000 rids must not stall the loop
        for rid in rids:
            if rid in seen:
                raise bad_request(f"rid: {rid!r} appears twice in the request", param="rid")
            seen.add(rid)
        if (self.max_queued_requests is not None
                and len(self.waiting) + len(rids) > self.max_queued_requests):
            raise APIError(429, f"Too many queued requests ({len(self.waiting)} waiting, "
                                f"max_queued_requests={self.max_queued_requests}); retry later",
                           err_type="TooManyRequests")
        self.waiting.update(rids)
        self.live[client_rid] = set(rids)
        self.engine_rids.update(rids)
        self.prompts.update(prompts or {})
        return Session(self, client_rid, rids, list(prompts or ()))


class Session:
    """One HTTP request's admitted engine requests; ``close`` (idempotent) releases them."""

    def __init__(self, ctx: ServingContext, client_rid: str, rids: list[str],
                 prompt_rids: list[str] = ()):
        self.ctx, self.client_rid, self.rids = ctx, client_rid, rids
        self.prompt_rids = prompt_rids
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.ctx.waiting.difference_update(self.rids)
            self.ctx.aborted.difference_update(self.rids)
            self.ctx.live.pop(self.client_rid, None)
            self.ctx.engine_rids.difference_update(self.rids)
            for rid in self.prompt_rids:
                self.ctx.prompts.pop(rid, None)


@dataclass(frozen=True)
class Warmup:
    """A prompt's warm-up (n > 1): the request's real arrival, queue time and cache hit, which
    its copies report instead of their own (the warm-up made their hit and their wait)."""

    started: float
    queue_time: float | None
    cached: int
    host_cached: int


async def run_request(ctx: ServingContext, req: GenerateRequest,
                      warmup: Warmup | None = None) -> AsyncIterator[RequestState]:
    """Submit ``req`` and yield its state after each output, the last one finished. Leaving the
    loop early (or a stop string) closes the engine stream, which aborts the request.
    ``warmup``: its prompt's warm-up (n > 1), whose timings and cache hit it reports."""
    sp = req.sampling_params
    state = RequestState(req, IncrementalDetokenizer(
        ctx.tokenizer, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
        no_stop_trim=sp.no_stop_trim, stop_regex=sp.stop_regex,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        prompt_ids=req.input_ids))
    if warmup is not None:
        state.start = warmup.started
    if req.rid in ctx.aborted:  # aborted while it waited for its warm-up: never submitted
        ctx.waiting.discard(req.rid)
        state.prompt_tokens = len(req.input_ids)
        state.end({"type": "abort", "message": "aborted by request"}, time.perf_counter())
        yield state
        return
    stream = ctx.engine.generate(req)
    refused = False  # by the engine: it never ran, so no latency to record
    try:
        while True:
            try:
                out = await stream.__anext__()
            except StopAsyncIteration:
                break
            except ValueError as e:  # the engine rejected the request; the message names the field
                refused = True
                raise bad_request(str(e), param=str(e).partition(":")[0]) from None
            except RuntimeError as e:  # the engine is not running
                refused = True
                raise unavailable(e) from None
            ctx.waiting.discard(req.rid)
            try:
                state.apply(out)
            except StopRegexTooSlow as e:  # this request's own pattern: it alone ends
                raise bad_request(str(e), param="stop_regex") from None
            if warmup is not None:
                state.cached_tokens, state.host_cached_tokens = warmup.cached, warmup.host_cached
                state.queue_time = warmup.queue_time
            yield state
            if state.finished:
                break
        if not state.finished:  # the engine ended the stream without a finished output
            state.delta = state.detok.finish()
            state.end({"type": "abort", "message": "engine stream ended"}, time.perf_counter())
            yield state
    finally:
        ctx.waiting.discard(req.rid)
        await stream.aclose()
        # A request the client cut (it left, or its stream was closed) is recorded up to the
        # cut, as the engine counts it (aborted); so is one /abort_request ended.
        if ctx.metrics is not None and not refused:
            ctx.metrics.observe_request(
                None if state.first_token_time is None else state.first_token_time - state.start,
                state.itl, state.e2e_latency, state.queue_time)


async def run_many(ctx: ServingContext, reqs: list[GenerateRequest],
                   warmups: list[Warmup | None] | None = None
                   ) -> AsyncIterator[tuple[int, RequestState]]:
    """Run several requests at once; yield (index into ``reqs``, state) in arrival order.
    Each request waits for its state to be consumed before folding in its next output, so a
    consumer always sees a consistent state (its ``delta`` included). Closing this generator
    cancels (and so aborts) every request still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            warmup = warmups[i] if warmups is not None else None
            async with aclosing(run_request(ctx, req, warmup)) as states:
                async for state in states:
                    consumed = asyncio.Event()
                    await queue.put((i, state, consumed))
                    await consumed.wait()
        except Exception as e:  # surfaced to the consumer, which owns the response
            await queue.put((i, e, None))
        finally:
            await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, consumed = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
                consumed.set()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request, coro):
    """Await ``coro`` unless the HTTP client disconnects first; then cancel it (closing its
    engine streams, which aborts the requests and frees their KV) and return a bare 499."""
    from starlette.responses import Response

    answer = await await_unless_disconnected(request, coro)
    return Response(status_code=499) if answer is None else answer
