"""SGLang's native ``POST /generate``, as SGLang's frontend client (``RuntimeEndpoint``) uses it.

Request: ``text`` or ``input_ids`` (one or a list), ``sampling_params`` (one dict for all or a
list; null and empty values mean "default"), ``stream``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``, ``rid``.
Response: one object per prompt (a list for list input; prompt-major when n > 1):
``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"cached_tokens", "cached_tokens_details": {"device", "host"}, "finish_reason", "e2e_latency",
...logprobs}}``. Logprob entries are ``[logprob, token_id, text_or_null]``;
``input_token_logprobs`` covers the prompt from ``logprob_start_len`` on and its first value
is null. Streams send cumulative ``text``.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ..worker.sampling_params import CONSTRAINT_KINDS, SamplingParams
from .detokenizer import token_texts
from .engine_protocol import GenerateRequest
from .api_errors import abort_error, as_api_error, bad_request
from .generation import (RequestState, ServingContext, Session, new_rid,
                         prepare_off_loop_if_large)
from .parallel_sampling import expand_copies, final_states, run_all
from .request_checks import (cache_namespace, check_batch_size, check_lengths,
                             check_sampling_params, check_text, check_token_ids)
from .sse import SSE_DONE, error_event, open_stream, sse

IntOrList = int | list[int] | None
BoolOrList = bool | list[bool] | None


class GenerateReqInput(BaseModel):
    """The body of POST /generate. Strict types: a string where a number belongs is a 400."""

    model_config = ConfigDict(strict=True, extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    stream: bool | None = False
    return_logprob: BoolOrList = None
    logprob_start_len: IntOrList = None
    top_logprobs_num: IntOrList = None
    return_text_in_logprobs: bool | None = False
    rid: str | list[str] | None = None
    priority: int | None = None
    routing_key: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None  # with extra_key, which cached prefixes it may share
    token_ids_logprob: list[int] | list[list[int]] | None = None  # not supported: a 400


def _per_item(value, i: int, count: int, name: str, default):
    """A top-level field given once for all prompts or as a list of one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name}: a list must have one entry per prompt "
                              f"({count}), got {len(value)}", param=name)
        value = value[i]
    return default if value is None else value


def _prompts(body: GenerateReqInput, ctx: ServingContext) -> tuple[list[list[int]], bool, str]:
    """Token ids of every prompt, whether the input was a batch, and the field they came from."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("text: give exactly one of text and input_ids", param="text")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        if not texts:
            raise bad_request("text: the prompt is empty", param="text")
        check_batch_size(len(texts), "text")  # before tokenizing them all
        for t in texts:
            check_text(t, "text")
        # "" is a prompt when the tokenizer gives it a BOS token (SGLang's frontend starts
        # programs with a gen that way); only no tokens at all is empty
        ids = [ctx.tokenizer.encode(t) for t in texts]
        if not all(ids):
            raise bad_request("text: the prompt is empty (no tokens)", param="text")
        return ids, isinstance(body.text, list), "text"
    ids = body.input_ids
    batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    check_batch_size(len(prompts), "input_ids")
    for p in prompts:
        if not p:
            raise bad_request("input_ids: the prompt is empty", param="input_ids")
        check_token_ids(p, ctx.vocab_size, "input_ids")
    return prompts, batch, "input_ids"


def build_requests(body: GenerateReqInput, ctx: ServingContext
                   ) -> tuple[list[GenerateRequest], list[list[GenerateRequest]], bool]:
    """Validate ``body`` and turn it into engine requests.

    Returns (the requests, per prompt the copies to run (n of them), whether the input was a
    batch). With n > 1 the first list holds one request per prompt, used to fill the cache.
    """
    if body.token_ids_logprob is not None:
        raise bad_request("token_ids_logprob: not supported; use top_logprobs_num",
                          param="token_ids_logprob")
    prompts, batch, prompt_field = _prompts(body, ctx)
    count = len(prompts)
    for rid in [body.rid] if isinstance(body.rid, str) else body.rid or []:
        check_text(rid, "rid")  # it names the request in every answer, so must encode
    base_rid = body.rid if isinstance(body.rid, str) else None
    firsts, copies = [], []
    for i, ids in enumerate(prompts):
        raw = _per_item(body.sampling_params, i, count, "sampling_params", {})
        # errors name the field as the client wrote it: sampling_params.top_p, or
        # sampling_params[1].top_p when each prompt has its own
        where = "sampling_params" + (f"[{i}]." if isinstance(body.sampling_params, list)
                                     else ".")
        try:
            sp = SamplingParams.from_dict(raw)
        except (ValueError, TypeError) as e:
            name, _, msg = str(e).partition(": ")
            raise bad_request(f"{where}{name}: {msg or e}", param=where + name) from None
        check_sampling_params(sp, ctx.vocab_size, where=where)
        # As SGLang: prompt + max_new_tokens must fit the context only when the client set
        # max_new_tokens; the default (128) is cut short at the context's end instead.
        explicit = isinstance(raw, dict) and raw.get("max_new_tokens") is not None
        check_lengths(len(ids), sp.max_new_tokens if explicit else 0, ctx.context_len,
                      prompt_field, where + "max_new_tokens", ctx.pool_tokens)
        return_logprob = _per_item(body.return_logprob, i, count, "return_logprob", False)
        start = _per_item(body.logprob_start_len, i, count, "logprob_start_len", -1)
        top_n = _per_item(body.top_logprobs_num, i, count, "top_logprobs_num", 0)
        if start == -1:
            start = len(ids) - 1  # SGLang: only the last prompt token (a single null entry)
        if return_logprob and not 0 <= start < len(ids):  # (ignored without logprobs)
            raise bad_request(f"logprob_start_len: must be -1 or in [0, {len(ids)}) for a "
                              f"{len(ids)}-token prompt, got {start}", param="logprob_start_len")
        if not 0 <= top_n <= ctx.vocab_size:  # a larger one stopped the engine (topk > vocab)
            raise bad_request(f"top_logprobs_num: must be in [0, {ctx.vocab_size}] (the vocab "
                              "size)", param="top_logprobs_num")
        if isinstance(body.rid, list):
            rid = _per_item(body.rid, i, count, "rid", None)
        else:
            rid = f"{base_rid}-{i}" if base_rid and batch else (base_rid or new_rid())
        req = GenerateRequest(
            rid=rid, input_ids=list(ids), sampling_params=sp, return_logprob=return_logprob,
            logprob_start_len=start if return_logprob else -1,
            top_logprobs_num=top_n if return_logprob else 0, priority=body.priority or 0,
            routing_key=body.routing_key,
            extra_key=cache_namespace(body.extra_key, body.cache_salt))
        firsts.append(req)
        copies.append(expand_copies(req, sp.n))
    return firsts, copies, batch


def _entries(pairs, with_text: bool, tokenizer) -> list[list]:
    pairs = list(pairs or [])
    texts = token_texts(tokenizer, [t for _, t in pairs]) if with_text else [None] * len(pairs)
    return [[lp, tid, text] for (lp, tid), text in zip(pairs, texts)]


def _top_entries(rows, with_text: bool, tokenizer) -> list:
    return [None if row is None else _entries(row, with_text, tokenizer) for row in rows or []]


def native_result(state: RequestState, tokenizer, with_text: bool) -> dict:
    """The response object for one request (also each streamed chunk: text is cumulative)."""
    meta = {
        "id": state.req.rid,
        "prompt_tokens": state.prompt_tokens or len(state.req.input_ids),
        "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens,
        "cached_tokens_details": {"device": state.cached_tokens - state.host_cached_tokens,
                                  "host": state.host_cached_tokens},
        "finish_reason": state.finish_reason,
        "e2e_latency": state.e2e_latency,
    }
    req = state.req
    if req.return_logprob:
        meta["input_token_logprobs"] = _entries(state.input_token_logprobs, with_text, tokenizer)
        meta["output_token_logprobs"] = _entries(state.output_token_logprobs, with_text,
                                                 tokenizer)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top_entries(state.input_top_logprobs, with_text,
                                                      tokenizer)
            meta["output_top_logprobs"] = _top_entries(state.output_top_logprobs, with_text,
                                                       tokenizer)
    return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}


# the client's field behind each grammar kind, for a grammar error from the scheduler
GRAMMAR_FIELDS = {kind: f"sampling_params.{kind}" for kind in CONSTRAINT_KINDS}


def failed(state: RequestState) -> bool:
    """Ended by the client's input (a 400) or the engine under it (5xx). A plain abort (no
    status: the client's own /abort_request) is a normal end."""
    return (state.finish_reason or {}).get("status_code", 0) >= 400


async def stream_events(ctx: ServingContext, firsts: list[GenerateRequest],
                        copies: list[list[GenerateRequest]], with_text: bool, multi: bool,
                        session: Session):
    """SSE events: after each output, that request's cumulative object (with ``index`` when
    several run); then ``[DONE]``. Closing the stream aborts what still runs."""
    try:
        first = True
        async with aclosing(run_all(ctx, firsts, copies)) as updates:
            async for i, state in updates:
                if first and failed(state):  # nothing sent: an HTTP error, as unstreamed
                    yield error_event(abort_error(state.finish_reason, GRAMMAR_FIELDS), True)
                    return
                first = False
                chunk = native_result(state, ctx.tokenizer, with_text)
                if multi:
                    chunk["index"] = i
                yield sse(chunk)
        yield SSE_DONE
    except Exception as e:  # in-band once the status line is gone, as SGLang does
        yield error_event(as_api_error(e), native=True)
        yield SSE_DONE
    finally:
        session.close()


async def generate(request: Request, ctx: ServingContext, body: GenerateReqInput):
    """``POST /generate``: one result (or a list of them), or an SSE stream of them."""
    firsts, copies, batch = await prepare_off_loop_if_large(request, build_requests, body, ctx)
    flat = [r for group in copies for r in group]
    # A batch's session has a key no prompt's rid can equal: aborting one prompt's rid must
    # not abort the others (a string rid names the whole batch, as in SGLang).
    key = body.rid if isinstance(body.rid, str) else (
        new_rid("batch-") if batch else firsts[0].rid)
    prompts = {first.rid: {c.rid for c in group} for first, group in zip(firsts, copies)
               if batch and len(group) > 1}
    size_field = ("sampling_params.n" if len(flat) > len(firsts)
                  else "text" if body.text is not None else "input_ids")
    session = ctx.open_session(key, flat, prompts, size_field)
    with_text = bool(body.return_text_in_logprobs)
    multi = batch or len(flat) > 1
    if body.stream:
        return await open_stream(
            request, stream_events(ctx, firsts, copies, with_text, multi, session), session)
    states = await final_states(request, ctx, session, firsts, copies, failed, GRAMMAR_FIELDS)
    if isinstance(states, Response):
        return states
    results = [native_result(s, ctx.tokenizer, with_text) for s in states]
    return results if multi else results[0]


async def abort_request(ctx: ServingContext, raw: bytes) -> dict:
    """``POST /abort_request``: ``{"rid": ...}`` or ``{"abort_all": true}``."""
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, RecursionError) as e:  # nested too deep: RecursionError
        raise bad_request(f"body: malformed JSON ({e})", param="body") from None
    if not isinstance(body, dict):
        raise bad_request("body: must be a JSON object", param="body")
    if not isinstance(body.get("abort_all", False), bool):  # "false" is truthy
        raise bad_request("abort_all: must be true or false", param="abort_all")
    if body.get("abort_all"):
        return {"aborted": await ctx.abort(abort_all=True)}
    if isinstance(body.get("rid"), str) and body["rid"]:
        return {"aborted": await ctx.abort(body["rid"])}
    raise bad_request("rid: give a request id (or abort_all: true)", param="rid")
