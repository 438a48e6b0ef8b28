"""n > 1 on the serving path (parallel sampling): each prompt is computed once into the radix
cache by a warm-up (max_new_tokens 0), then its n copies run, sharing that KV; the copies
report the request's real arrival, queue time and cache hit, which are the warm-up's.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi.responses import Response

from .engine_protocol import GenerateRequest
from .engine_requests import copy_seed
from .api_errors import abort_error, bad_request, unavailable
from .generation import (RequestState, ServingContext, Warmup, new_rid, run_many,
                         until_disconnect)


async def prefill_only(ctx: ServingContext, req: GenerateRequest, copies: list[str],
                       started: float) -> Warmup | None:
    """Compute ``req``'s prompt into the radix cache (max_new_tokens 0), so its ``copies``
    (rids; n > 1) submitted after it reuse its KV instead of each computing the prompt. The
    warm-up's rid is unique (a client's rid can never collide with it), and aborting any copy
    aborts it. Returns its timings from ``started`` (the request's arrival) and the prompt's
    real cache hit; None if the warm-up did not run."""
    if ctx.aborted.intersection(copies):
        return None
    warm = replace(req, rid=new_rid(req.rid + "-prefill-"), return_logprob=False,
                   logprob_start_len=-1, top_logprobs_num=0,
                   sampling_params=replace(req.sampling_params, max_new_tokens=0,
                                           min_new_tokens=0, n=1))
    ctx.warmups.update(dict.fromkeys(copies, warm.rid))
    hit = None
    try:
        async with aclosing(ctx.engine.generate(warm)) as outputs:
            async for out in outputs:
                # capped as a generating request's: it recomputes the prompt's last token
                cached = min(out.cached_tokens, len(req.input_ids) - 1)
                hit = Warmup(started, out.queue_time, cached,
                             min(out.host_cached_tokens, cached))
    except ValueError as e:  # refused by the engine: the message names the field
        raise bad_request(str(e), param=str(e).partition(":")[0]) from None
    except RuntimeError as e:  # the engine is not running
        raise unavailable(e) from None
    finally:
        for rid in copies:
            ctx.warmups.pop(rid, None)
    return hit


async def run_all(ctx: ServingContext, firsts: list[GenerateRequest],
                  copies: list[list[GenerateRequest]]) -> AsyncIterator[tuple[int, RequestState]]:
    """Yield (flat index, state) for every copy of every prompt. With n > 1 each prompt is
    computed once into the radix cache first, so its copies share that KV; they report the
    warm-up's cache hit as theirs (the prompt's real one, not the hit the warm-up gave them)."""
    flat = [r for group in copies for r in group]
    warmups = None
    if len(flat) > len(firsts):  # the prompts' warm-ups run together, as one batch would
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(prefill_only(ctx, req, [r.rid for r in group], started))
                 for req, group in zip(firsts, copies, strict=True)]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:  # one failed, or the client left: the others stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        warmups = [w for w, group in zip(done, copies) for _ in group]
    async with aclosing(run_many(ctx, flat, warmups)) as updates:
        async for i, state in updates:
            yield i, state


async def collect_states(ctx: ServingContext, firsts: list[GenerateRequest],
                         copies: list[list[GenerateRequest]]) -> list[RequestState]:
    """Run every copy of every prompt to the end; their final states, prompt-major."""
    results: list[RequestState | None] = [None] * sum(len(g) for g in copies)
    async with aclosing(run_all(ctx, firsts, copies)) as updates:
        async for i, state in updates:
            results[i] = state
    return results


async def final_states(request, ctx: ServingContext, session, firsts: list[GenerateRequest],
                       copies: list[list[GenerateRequest]], failed: Callable, fields: dict):
    """``collect_states`` for an unstreamed answer: the final states (the session closed
    after), or the 499 Response when the client went away; the first state ``failed`` picks
    is raised as its API error (``fields``: the client's field behind each grammar kind)."""
    try:
        states = await until_disconnect(request, collect_states(ctx, firsts, copies))
    finally:
        session.close()
    if isinstance(states, Response):
        return states
    failure = next((s for s in states if failed(s)), None)
    if failure is not None:
        raise abort_error(failure.finish_reason, fields)
    return states


def expand_copies(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """``n`` copies of ``req`` with rids ``rid-0..`` and seeds ``seed+i`` (so copies differ
    but copy 0 equals the n=1 request with the same seed); a seed past the largest wraps
    around, as the sampler takes seeds modulo 2**64."""
    if n == 1:
        return [req]
    sp = req.sampling_params
    return [replace(req, rid=f"{req.rid}-{i}",
                    sampling_params=replace(sp, n=1, seed=copy_seed(sp.seed, i)))
            for i in range(n)]
