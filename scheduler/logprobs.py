"""Logprobs from a forward's output to a request and its outputs.

Layout (SGLang's): ``input_token_logprobs`` has one entry per prompt token from the request's
logprob start on, only the first one None (nothing before it in this step predicts it; across
chunks of a chunked prefill the values run on, see ``collect_input_logprobs``); output
logprobs come one per sampled token. Entries are ``(logprob, token_id)``; tops are lists of
them, best first.
"""

from __future__ import annotations

from ..worker.forward_batch import ForwardOutput
from .request import Req, RequestOutput


def collect_input_logprobs(req: Req, output: ForwardOutput, i: int, start: int,
                           offset: int) -> bool:
    """Add row ``i``'s input logprobs of positions ``start + offset ..`` (this step's) to
    ``req``; True once the whole prompt's are in. The entry at ``logprob_start_len`` gets
    None (SGLang's null first entry: nothing the request computed predicts it). A later chunk
    adds no null: its first token was scored at the end of the chunk before (the worker's
    ``next_prompt_ids``), so the values run on without a gap. Mutates ``req``'s input
    logprob lists and pending flag."""
    first = start + offset
    values = output.input_token_logprobs[i] if output.input_token_logprobs else None
    values = [] if values is None else values.tolist()
    if first == req.logprob_start_len:
        req.input_token_logprobs.append((None, req.tokens(first, first + 1)[0]))
    req.input_token_logprobs += list(zip(values, req.tokens(first + 1, first + 1 + len(values))))
    tops = output.input_top_logprobs[i] if output.input_top_logprobs else None
    if tops is not None:
        if first == req.logprob_start_len:
            req.input_top_logprobs.append(None)
        req.input_top_logprobs += [list(zip(v, t)) for v, t in
                                   zip(tops[0].tolist(), tops[1].tolist())]
    if req.cached_len >= req.prompt_len:
        req.input_logprobs_pending = False
    return not req.input_logprobs_pending


def forget_input_logprobs(req: Req) -> None:
    """``req`` gives up its slots before its prompt is complete (a chunked request retracted):
    the input logprobs collected so far are computed again from ``logprob_start_len`` when it
    comes back (its cache match stops there), so they start over."""
    if req.input_logprobs_pending:
        req.input_token_logprobs = []
        req.input_top_logprobs = []


def attach_logprobs(out: RequestOutput, req: Req, new_ids: list[int],
                    output: ForwardOutput | None, i: int, input_logprobs_done: bool) -> None:
    """Fill ``out``'s logprob fields: the sampled token's (and its tops) from row ``i`` of
    ``output`` when the request asked for them, and the prompt's once they are complete."""
    if req.return_logprob and new_ids and output is not None:
        if output.next_token_logprobs is not None:
            out.output_token_logprobs = [(float(output.next_token_logprobs[i]), new_ids[0])]
        top = output.top_logprobs[i] if output.top_logprobs else None
        if top is not None:
            out.output_top_logprobs = [list(zip(top[0].tolist(), top[1].tolist()))]
    if input_logprobs_done:
        out.input_token_logprobs = req.input_token_logprobs
        out.input_top_logprobs = req.input_top_logprobs or None
