"""When a request is done: length limits, EOS, stop token ids and stop strings.

Stop strings are matched on text, and a stop string may span several tokens, so the check
decodes the tail of the output: ``max stop-string length + 1`` tokens cover any stop string
that ends in the newest token, as long as each token decodes to at least one character.
``trim_stop_text`` removes the matched stop from the text a client sees (unless
``no_stop_trim``); the token ids are kept as generated.
"""

from __future__ import annotations

from typing import Callable, Iterable

from .request import FinishReason, Req

Decode = Callable[[list[int]], str]


class StopChecker:
    def __init__(self, eos_token_ids: Iterable[int] = (), decode: Decode | None = None,
                 max_context_len: int | None = None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode
        self.max_context_len = max_context_len

    def check(self, req: Req) -> FinishReason | None:
        """Why ``req`` is finished after its newest token, or None. Reads only; the caller sets
        ``req.finish_reason``. In SGLang's order: length first, then tokens, then strings."""
        sp, out = req.sampling_params, req.output_ids
        if len(out) >= sp.max_new_tokens:
            return FinishReason.of_length(len(out))
        if self.max_context_len is not None and req.total_len >= self.max_context_len:
            return FinishReason.of_length(len(out))
        if len(out) < sp.min_new_tokens:
            return None
        last = out[-1]
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
            return FinishReason.stop(last)
        if sp.stop:
            if self.decode is None:
                raise ValueError("stop: stop strings need a tokenizer to decode with")
            window = max(len(s) for s in sp.stop) + 1
            tail = self.decode(out[-window:])
            for s in sp.stop:
                if s in tail:
                    return FinishReason.stop(s)
        return None


def trim_stop_text(text: str, finish_reason: FinishReason | None, no_stop_trim: bool) -> str:
    """The output text a client sees: cut just before a matched stop string."""
    if no_stop_trim or finish_reason is None or not isinstance(finish_reason.matched, str):
        return text
    cut = text.find(finish_reason.matched)
    return text if cut < 0 else text[:cut]


def visible_output_ids(output_ids: list[int], finish_reason: FinishReason | None,
                       no_stop_trim: bool) -> list[int]:
    """The ids to detokenize for the client's text: a matched stop token is not shown."""
    if (not no_stop_trim and finish_reason is not None and finish_reason.type == "stop"
            and isinstance(finish_reason.matched, int) and output_ids
            and output_ids[-1] == finish_reason.matched):
        return output_ids[:-1]
    return output_ids
