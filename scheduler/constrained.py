"""Constrained decoding in the scheduler: the grammar queue, batch masks, accepting sampled
tokens, and jump-forward.

A request with ``regex``, ``json_schema`` or ``ebnf`` goes through these stages (the scheduler
calls each one from a one-line hook):

1. ``add``: its grammar goes to the ``GrammarBackend`` (compiled on a thread pool, cached by
   (kind, text)); the request waits in the grammar queue, not the waiting queue.
2. ``poll``, at the start of every step, never blocking: a compiled grammar gives the request
   its matcher (``req.grammar``) and it joins the waiting queue; a failed or timed-out
   compilation finishes it with an abort reason naming the problem.
3. ``fill_mask``: a batch with constrained rows carries ``ForwardBatch.vocab_mask``.
4. ``on_token``, from ``process_output``: the matcher accepts the sampled token; a terminated
   grammar finishes the request with reason stop.
5. Jump-forward (unless ``disable_jump_forward``): when the grammar forces a continuation,
   its tokens are appended at once (``GrammarState.jump_forward``). Only the token sampled in
   this step is re-tokenized with it (window 1): it is the only one not yet sent to the client
   and not yet in the KV cache, so retracting it needs no KV cropping and no retraction on the
   client's side. The request then holds several tokens past ``cached_len``; its next step
   computes them as one extend over its cached prefix (``split_extends``) instead of a decode
   step per token. When only a stop token may follow, it is appended and the request finishes
   without another forward pass. The forced text at the very start (``{"name": "``) is
   appended when the grammar is ready and sent before the first forward pass.
6. Retraction: the request keeps its output tokens and gets a matcher re-created from them.

Jump-forward is skipped for requests that want logprobs (the forced tokens have none) or have
stop strings or stop token ids (forced text is not searched for them). The scheduler does not
overlap batches while a constrained request runs: batch N+1's mask needs batch N's tokens
accepted.
"""

from __future__ import annotations

from ..worker.sampling_params import SamplingParams
from .batch import ScheduleBatch
from .grammar import GrammarError, validate_grammar
from .grammar_compile import GrammarBackend, GrammarFuture
from .grammar_state import MaskFiller
from .request import FinishReason, Req

IDLE_WAIT_S = 0.005  # how long poll waits for a compilation when nothing else can run


def check_constraint(params: SamplingParams, grammars: "ConstrainedDecoding | None") -> None:
    """Raise ``ValueError`` ("<field>: ...") for a constraint this scheduler cannot run: no
    grammar backend, or a grammar that does not parse (cheap, no compilation)."""
    if params.constraint is None:
        return
    kind, text = params.constraint
    if grammars is None:
        raise ValueError(f"{kind}: constrained decoding needs a tokenizer; this scheduler was "
                         "built without one")
    validate_grammar(kind, text)


def split_extends(reqs: list[Req]) -> tuple[list[Req], list[Req]]:
    """Split running requests into those holding more than one token past ``cached_len`` (a
    jump-forward appended them: they run as an extend, ``extend_len`` set here) and those
    that run a decode step."""
    extend, decode = [], []
    for r in reqs:
        pending = r.total_len - r.cached_len
        if pending > 1:
            r.extend_len = pending
            extend.append(r)
        else:
            decode.append(r)
    return extend, decode


class ConstrainedDecoding:
    """The scheduler's constrained-decoding state: the grammar queue and jump-forward."""

    def __init__(self, backend: GrammarBackend, max_context_len: int, *,
                 jump_forward: bool = True, mask_threads: int = 1):
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.max_context_len = max_context_len
        self.jump_forward = jump_forward
        self.fill = MaskFiller(backend.vocab, mask_threads)
        stops = backend.vocab.stop_ids
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.stop_token = eos if eos in stops else (min(stops) if stops else None)
        self.queue: list[tuple[Req, GrammarFuture]] = []
        self.num_jumps = 0  # jump-forwards taken
        self.jump_tokens = 0  # tokens they appended (net of retracted ones)

    # ------------------------------------------------------------------ grammar queue
    def add(self, req: Req) -> None:
        """Start compiling ``req``'s grammar; ``req`` waits in the grammar queue."""
        kind, text = req.sampling_params.constraint
        self.queue.append((req, self.backend.submit(kind, text)))

    def remove(self, reqs: list[Req]) -> set[int]:
        """Take ``reqs`` out of the grammar queue (abort), in one pass; the ``id``s of those
        that were there."""
        ids = {id(r) for r in reqs}
        removed, kept = set(), []
        for req, future in self.queue:
            if id(req) in ids:
                removed.add(id(req))
                future.release()  # nobody else waits: a queued compilation is dropped
            else:
                kept.append((req, future))
        self.queue = kept
        return removed

    def poll(self, idle: bool = False) -> list[tuple[Req, list[int]]]:
        """Requests whose compilation is done leave the queue, in arrival order, as
        ``(req, tokens to send now)``. A failed one comes finished (abort reason); a compiled
        one has ``req.grammar`` set and its forced start appended to ``output_ids``: the caller
        queues it for prefill. With ``idle`` (nothing else to run) waits a few milliseconds
        for the oldest compilation instead of returning at once to a spinning loop."""
        if idle and self.queue:
            self.queue[0][1].wait(IDLE_WAIT_S)
        done, pending = [], []
        for req, future in self.queue:
            if not future.done():
                pending.append((req, future))
                continue
            try:
                compiled = future.result()
            except GrammarError as e:  # the client's grammar (400), or no capacity now (503)
                req.finish_reason = FinishReason.abort(str(e), status_code=e.status_code)
                done.append((req, []))
                continue
            finally:  # after the result: the last waiter gone would cancel a queued compile
                future.release()  # and read its own "no request waits" instead of the 429
            req.grammar = self.backend.new_state(compiled, req.output_ids)
            if req.grammar.allows_nothing():  # an empty language: [^\s\S]
                req.finish_reason = FinishReason.abort(
                    f"{req.sampling_params.constraint[0]}: no text satisfies the grammar",
                    status_code=400)
                done.append((req, []))
                continue
            done.append((req, self._jump(req)))
        self.queue = pending
        return done

    # ------------------------------------------------------------------ per step
    def fill_mask(self, batch: ScheduleBatch) -> None:
        """Set ``batch.forward_batch.vocab_mask`` from its constrained requests' matchers (left
        None when it has none). Matchers unchanged."""
        states = [r.grammar for r in batch.reqs]
        if any(s is not None for s in states):
            mask = batch.forward_batch.vocab_mask = self.fill(states)
            empty = (mask == 0).all(dim=1).tolist()  # one pass over the batch
            for i, state in enumerate(states):
                if state is not None and empty[i]:
                    # A dead end the grammar let the model into (xgrammar does not look
                    # ahead): the sampler cannot draw from an empty row, so it draws the
                    # stop token (invisible in the text) and on_token ends the request.
                    state.dead_end = True
                    self._allow_only_stop(mask, i)

    def on_token(self, req: Req) -> list[int]:
        """``req``'s newest output token was just sampled (under its mask). Accept it into the
        matcher; if the grammar terminated, finish with reason stop; else try a jump-forward.
        Returns the output tokens this step added, which is what the client gets: the sampled
        one, or what replaced it. Mutates ``req.output_ids``, ``req.finish_reason``, the
        matcher."""
        state, out = req.grammar, req.output_ids
        start, token = len(out) - 1, out[-1]
        if state.dead_end:  # see fill_mask: the client's grammar cannot go on
            req.finish_reason = FinishReason.abort(
                f"{req.sampling_params.constraint[0]}: the grammar allows no further token "
                f"after {len(out) - 1} output tokens", status_code=400)
            return out[start:]
        if not state.accept(token):  # only if the mask was not applied: a worker bug
            req.finish_reason = FinishReason.abort(
                f"{req.sampling_params.constraint[0]}: sampled token {token} is not allowed "
                "by the grammar", status_code=500)
        elif state.is_terminated() and not req.finished:
            req.finish_reason = FinishReason.stop(token)
        if not req.finished:
            self._jump(req)
        return out[start:]

    def _allow_only_stop(self, mask, row: int) -> None:
        """Row ``row`` of the batch bitmask allows the stop token alone (every token when the
        grammar has none)."""
        if self.stop_token is None:
            mask[row] = -1
            return
        mask[row] = 0
        bit = self.stop_token & 31
        mask[row, self.stop_token >> 5] = (1 << bit) - (1 << 32 if bit == 31 else 0)

    def on_retract(self, reqs: list[Req]) -> None:
        """Retracted requests keep their output tokens; re-create their matchers from them."""
        for req in reqs:
            if req.grammar is not None:
                req.grammar = self.backend.new_state(req.grammar.compiled, req.output_ids)

    # ------------------------------------------------------------------ jump-forward
    def _may_jump(self, req: Req) -> bool:
        sp = req.sampling_params
        return (self.jump_forward and not req.return_logprob and not sp.stop
                and not sp.stop_regex and not sp.stop_token_ids
                and req.to_abort is None and req.remaining_new_tokens() > 1)

    def _jump(self, req: Req) -> list[int]:
        """Append what the grammar forces after ``req``'s output (retracting its last token
        where the tokenizer merges it with the forced text), then the stop token if nothing
        else may follow (finishing the request). Returns the tokens appended. Only within
        ``max_new_tokens`` and the context, leaving room for one more sampled token."""
        if not self._may_jump(req):
            return []
        state, out = req.grammar, req.output_ids
        start = len(out)
        jump = state.jump_forward(self.tokenizer, out, window=1)
        if jump is not None:
            kept = len(out) - jump.retract
            growth = len(jump.tokens) - jump.retract
            if (len(out) + growth < req.sampling_params.max_new_tokens
                    and req.total_len + growth < self.max_context_len):
                del out[kept:]
                out += jump.tokens
                start = min(start, kept)
                self.num_jumps += 1
                self.jump_tokens += growth
            else:  # no room: undo, and let the request decode to its length limit
                state.rollback(len(jump.tokens))
                for t in out[kept:]:
                    state.accept(t)
        if self.stop_token is not None and state.only_stop_allowed():
            state.accept(self.stop_token)
            out.append(self.stop_token)
            req.finish_reason = FinishReason.stop(self.stop_token)
        return out[start:]


def make_constrained(tokenizer, vocab_size: int, eos_token_ids, max_context_len: int,
                     compile_timeout_s: float, jump_forward: bool) -> ConstrainedDecoding:
    """A ``ConstrainedDecoding`` over a new ``GrammarBackend`` for ``tokenizer``; the
    grammar's stop tokens are the scheduler's EOS ids that the tokenizer knows."""
    stops = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
    backend = GrammarBackend(tokenizer, vocab_size, compile_timeout_s=compile_timeout_s,
                             stop_token_ids=stops or None)
    return ConstrainedDecoding(backend, max_context_len, jump_forward=jump_forward)
