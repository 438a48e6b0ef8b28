"""Running OpenAI completions and chat completions: whole responses and SSE streams.

Request parsing lives in ``openai_api``, response shapes in ``openai_responses``; this module
drives the engine through ``generation`` and decides what each stream chunk carries.
"""

from __future__ import annotations

import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..worker.sampling_params import CONSTRAINT_KINDS
from . import openai_api as oa
from . import openai_responses as res
from .api_errors import abort_error, as_api_error
from .generation import RequestState, ServingContext, Session, prepare_off_loop_if_large
from .parallel_sampling import final_states, run_all
from .sse import SSE_DONE, error_event, open_stream, sse
from .tool_calls import ToolPlan, ToolStream


def _is_abort(state: RequestState) -> bool:
    return state.finished and (state.finish_reason or {}).get("type") == "abort"


def _grammar_fields(body) -> dict[str, str]:
    """The client's field behind each grammar kind, for a grammar error from the scheduler."""
    names, tools = oa.client_field_names(body), "tools" if getattr(body, "tools", None) else None
    return {kind: names.get(kind) or (kind if getattr(body, kind, None) else tools) or kind
            for kind in CONSTRAINT_KINDS}


def _chunk_usage(body, state: RequestState) -> dict | None:
    """``stream_options.continuous_usage_stats`` (vLLM's and SGLang's; with ``include_usage``):
    each chunk carries its choice's usage so far. Else null, as OpenAI's chunks."""
    opts = body.stream_options
    if opts and opts.include_usage and opts.continuous_usage_stats:
        return res.usage([state], 1)
    return None


# ---------------------------------------------------------------------------------------------
# /v1/completions


async def completions(request: Request, ctx: ServingContext, body: oa.CompletionRequest):
    batch = await prepare_off_loop_if_large(request, oa.completion_requests, body, ctx)
    firsts, copies = batch.firsts, batch.copies
    session = ctx.open_session(batch.rid, [r for group in copies for r in group], None,
                               "n" if any(len(group) > 1 for group in copies) else "prompt")
    if isinstance(body.prompt, str):
        prompts = [body.prompt]
    elif all(isinstance(p, str) for p in body.prompt):
        prompts = list(body.prompt)
    else:  # token ids, echoed as they decode with their special tokens (openai_responses)
        prompts = [ctx.tokenizer.decode(r.input_ids, skip_special_tokens=False) if body.echo
                   else "" for r in firsts]
    if body.stream:  # never with best_of > n (a 400)
        return await open_stream(request, _completion_events(ctx, body, batch, prompts, session),
                                 session)
    states = await final_states(request, ctx, session, firsts, copies, _is_abort,
                                _grammar_fields(body))
    if isinstance(states, Response):
        return states
    candidates = len(copies[0])
    shown = res.most_likely(states, candidates, batch.n) if candidates > batch.n else states
    choices = [res.completion_choice(i, s, body, ctx.tokenizer, prompts[i // batch.n])
               for i, s in enumerate(shown)]
    return JSONResponse(res.envelope("text_completion", batch.rid, ctx.model_name, choices,
                                     res.usage(states, candidates)))


async def _completion_events(ctx, body: oa.CompletionRequest, batch: oa.CompletionBatch,
                             prompts: list[str], session: Session):
    firsts, copies, base, n = batch.firsts, batch.copies, batch.rid, batch.n
    sent_logprobs: dict[int, int] = {}  # choice index -> output tokens whose logprobs went
    offsets: dict[int, res.OutputOffsets] = {}  # choice index -> its output's text offsets
    finals: dict[int, RequestState] = {}
    created = int(time.time())
    try:
        async with aclosing(run_all(ctx, firsts, copies)) as updates:
            async for i, state in updates:
                if _is_abort(state):
                    yield error_event(abort_error(state.finish_reason, _grammar_fields(body)))
                    break
                first = i not in sent_logprobs
                text = (prompts[i // n] if body.echo and first else "") + state.delta
                if state.finished:
                    finals[i] = state
                if not (text or state.finished or first):
                    continue  # text held back (partial character or possible stop string)
                logprobs, start = None, sent_logprobs.get(i, 0)
                if body.logprobs is not None:
                    # tokens go out once their offsets are known: a token ending inside a
                    # character waits for the token that completes it
                    echoed = prompts[i // n] if body.echo else ""
                    if first:
                        offsets[i] = res.output_offsets(state, ctx.tokenizer, len(echoed))
                    offsets[i].update(state.output_token_logprobs, final=state.finished)
                    known = offsets[i].offsets
                    logprobs = res.completion_chunk_logprobs(
                        state, body.logprobs, ctx.tokenizer, start, known[start:],
                        echoed if body.echo and first else None)
                    sent_logprobs[i] = len(known)
                else:
                    sent_logprobs[i] = len(state.output_token_logprobs)
                choice = {"index": i, "text": text, "logprobs": logprobs,
                          **res.finish_fields(state)}
                yield sse(res.envelope("text_completion", base, ctx.model_name, [choice],
                                       _chunk_usage(body, state), created))
            else:
                if body.stream_options and body.stream_options.include_usage:
                    states = [finals[i] for i in sorted(finals)]
                    yield sse(res.envelope("text_completion", base, ctx.model_name, [],
                                           res.usage(states, n), created))
        yield SSE_DONE
    except Exception as e:
        yield error_event(as_api_error(e))
        yield SSE_DONE
    finally:
        session.close()


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions


async def chat_completions(request: Request, ctx: ServingContext,
                           body: oa.ChatCompletionRequest):
    first, copies, plan = await prepare_off_loop_if_large(request, oa.chat_requests, body, ctx)
    session = ctx.open_session(first.rid, copies)
    if body.stream:
        return await open_stream(request, _chat_events(ctx, body, first, copies, session, plan),
                                 session)
    states = await final_states(request, ctx, session, [first], [copies], _is_abort,
                                _grammar_fields(body))
    if isinstance(states, Response):
        return states
    choices = [res.chat_choice(i, s, body, ctx.tokenizer, plan) for i, s in enumerate(states)]
    return JSONResponse(res.envelope("chat.completion", first.rid, ctx.model_name, choices,
                                     res.usage(states, len(copies))))


async def _chat_events(ctx, body: oa.ChatCompletionRequest, first, copies, session: Session,
                       plan: ToolPlan):
    started: dict[int, int] = {}  # choice index -> output logprobs sent
    finals: dict[int, RequestState] = {}
    tools: dict[int, ToolStream] = {}  # choice index -> its reply's content/call split
    created = int(time.time())

    def chunk(i: int, delta: dict, logprobs, state: RequestState, finished: bool,
              fields: dict | None = None) -> str:
        if fields is None:
            fields = res.finish_fields(state) if finished else {"finish_reason": None}
        choice = {"index": i, "delta": delta, "logprobs": logprobs, **fields}
        return sse(res.envelope("chat.completion.chunk", first.rid, ctx.model_name, [choice],
                               _chunk_usage(body, state), created))

    try:
        async with aclosing(run_all(ctx, [first], [copies])) as updates:
            async for i, state in updates:
                if _is_abort(state):
                    yield error_event(abort_error(state.finish_reason, _grammar_fields(body)))
                    break
                if i not in started:
                    started[i] = 0
                    if plan.parser is not None:
                        tools[i] = ToolStream(plan.parser, plan.names, plan.max_calls)
                    yield chunk(i, {"role": "assistant", "content": ""}, None, state, False)
                if state.finished:
                    finals[i] = state
                text, calls = state.delta, []
                if i in tools:  # content only as far as it cannot be the start of a call
                    text = tools[i].update(state.text)
                    if state.finished:
                        rest, calls = tools[i].finish(state.text)
                        text += rest
                if not (text or state.finished):
                    continue  # text held back (partial character, possible stop or call)
                logprobs, end = None, len(state.output_token_logprobs)
                if body.logprobs:
                    logprobs = res.chat_logprobs(state.output_token_logprobs[started[i]:end],
                                                state.output_top_logprobs[started[i]:end],
                                                ctx.tokenizer)
                started[i] = end
                delta = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = [c.to_openai(index=k) for k, c in enumerate(calls)]
                yield chunk(i, delta, logprobs, state, state.finished,
                            res.tool_finish_fields(state) if calls else None)
            else:
                if body.stream_options and body.stream_options.include_usage:
                    states = [finals[i] for i in sorted(finals)]
                    yield sse(res.envelope("chat.completion.chunk", first.rid, ctx.model_name,
                                           [], res.usage(states, len(copies)), created))
        yield SSE_DONE
    except Exception as e:
        yield error_event(as_api_error(e))
        yield SSE_DONE
    finally:
        session.close()
