"""OpenAI response shapes for ``/v1/completions`` and ``/v1/chat/completions``: choices, logprobs,
usage and the envelope around them, for whole answers and stream chunks alike.

Completions' ``echo`` with ``logprobs``: ``text[text_offset[i]:]`` begins with ``tokens[i]``.
Offsets run over the prompt's ids decoded with special tokens kept, aligned so that the echoed
text is the tail of that string. A token-id prompt is echoed as exactly that string, so its BOS
is in the text, at offset 0. A text prompt is echoed as the client sent it: a special token
that the client wrote ("<|im_start|>") has its width, one the tokenizer added (the BOS) is
listed by name at offset 0 but is in no text.
"""

from __future__ import annotations

import time

from .detokenizer import REPLACEMENT_CHAR, TokenBytes, text_offsets, token_texts
from .generation import RequestState
from .tool_calls import ToolPlan


def usage(states: list[RequestState], n: int) -> dict:
    """The answer's token counts; ``states`` prompt-major, ``n`` copies per prompt. Prompt and
    cached tokens count once per prompt (from its first copy: every copy has the same prompt
    and reports the prompt's own cache hit, see parallel_sampling.run_all); completion tokens count
    for every copy, best_of candidates left out of the answer included (as OpenAI bills
    them)."""
    firsts = states[::n]
    prompt = sum(s.prompt_tokens or len(s.req.input_ids) for s in firsts)
    completion = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


def most_likely(states: list[RequestState], candidates: int, n: int) -> list[RequestState]:
    """best_of: per prompt (``candidates`` consecutive states), the ``n`` with the highest
    output logprob per token (OpenAI's "best"; a sum would favour the shortest), most likely
    first, empty ones last (ties keep their order)."""
    kept = []
    for start in range(0, len(states), candidates):
        group = states[start:start + candidates]
        kept += sorted(group, key=_mean_logprob, reverse=True)[:n]
    return kept


def _mean_logprob(state: RequestState) -> float:
    values = [lp for lp, _ in state.output_token_logprobs if lp is not None]
    return sum(values) / len(values) if values else float("-inf")


def finish_fields(state: RequestState) -> dict:
    reason = state.finish_reason if state.finished else None
    return {"finish_reason": None if reason is None else reason.get("type"),
            "matched_stop": None if reason is None else reason.get("matched")}


# ---------------------------------------------------------------------------------------------
# Logprobs


def completion_logprobs(pairs, tops, tokenizer, offsets: list[int]) -> dict:
    """OpenAI's legacy logprobs object for the (logprob, id) ``pairs`` at text ``offsets``."""
    top = []
    for row in tops or [None] * len(pairs):
        if row is None:
            top.append(None)
        else:
            names = token_texts(tokenizer, [t for _, t in row])
            top.append({name: lp for name, (lp, _) in zip(names, row)})
    return {"tokens": token_texts(tokenizer, [t for _, t in pairs]),
            "token_logprobs": [lp for lp, _ in pairs],
            "top_logprobs": top if tops is not None else None, "text_offset": offsets}


def prompt_offsets(tokenizer, ids: list[int], echoed: str) -> list[int]:
    """Offsets of the prompt's tokens in ``echoed`` (see the module docstring)."""
    with_specials = tokenizer.decode(ids, skip_special_tokens=False)
    if not with_specials.endswith(echoed):  # the tokenizer normalised the text: go by what
        return text_offsets(tokenizer, ids, 0, skip_special_tokens=True)  # is visible
    shift = len(with_specials) - len(echoed)
    return [max(o - shift, 0) for o in text_offsets(tokenizer, ids, 0, False)]


class OutputOffsets:
    """The text offsets of a choice's output tokens as they arrive: ``offsets`` grows to equal
    ``text_offsets`` over the whole output, whatever the chunks.

    Offsets are taken a window of tokens at a time, a window closing where its text ends on a
    whole character (as ``text_offsets`` closes them; the last one when the output ends), so an
    offset once known never changes. A stream cannot take a chunk's tokens alone: the first
    may finish a character begun before it, and the text it releases may begin with an
    earlier token's text held back as a possible stop string."""

    def __init__(self, tokenizer, start: int, skip_special_tokens: bool):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.offsets: list[int] = []
        self._seen = 0  # tokens taken from the output
        self._window: list[int] = []
        self._position = start  # where the window's text begins

    def update(self, pairs: list, final: bool) -> None:
        """Take the new tokens of ``pairs`` (the output's (logprob, id) so far); ``final``:
        the output ended, so a window left open closes too."""
        for _, token in pairs[self._seen:]:
            self._window.append(token)
            text = self._decode(self._window)
            if not text.endswith(REPLACEMENT_CHAR):
                self._close(text)
        self._seen = len(pairs)
        if final and self._window:
            self._close(self._decode(self._window))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _close(self, text: str) -> None:
        """Close the window, whose decoded text is ``text``."""
        self.offsets += text_offsets(self.tokenizer, self._window, self._position,
                                     self.skip_special_tokens)
        self._position += len(text)
        self._window = []


def output_offsets(state: RequestState, tokenizer, start: int) -> OutputOffsets:
    """An OutputOffsets for ``state``'s output, whose text begins at ``start``."""
    return OutputOffsets(tokenizer, start, state.req.sampling_params.skip_special_tokens)


def completion_chunk_logprobs(state: RequestState, logprobs: int, tokenizer, start: int,
                              offsets: list[int], echoed: str | None) -> dict:
    """Logprobs of the output tokens from ``start`` on, one per offset in ``offsets`` (from an
    OutputOffsets); with ``echoed`` (the prompt's echo, in a whole answer or a choice's first
    chunk) the prompt's tokens before them."""
    end = start + len(offsets)
    pairs = list(state.output_token_logprobs[start:end])
    tops = list(state.output_top_logprobs[start:end])
    offsets = list(offsets)
    if echoed is not None:
        inputs = list(state.input_token_logprobs or [])
        offsets = prompt_offsets(tokenizer, [t for _, t in inputs], echoed) + offsets
        pairs = inputs + pairs
        tops = list(state.input_top_logprobs or [None] * len(inputs)) + tops
    return completion_logprobs(pairs, tops if logprobs > 0 else None, tokenizer, offsets)


def chat_logprobs(pairs, tops, tokenizer) -> dict:
    """``logprobs.content``; ``bytes`` are each token's own bytes, so the bytes of the tokens
    that split a character join into it (their ``token`` text is U+FFFD)."""
    token_bytes = TokenBytes.of(tokenizer)
    texts = token_texts(tokenizer, [t for _, t in pairs])
    content = []
    for k, (text, (lp, token)) in enumerate(zip(texts, pairs)):
        row = tops[k] if tops and k < len(tops) and tops[k] else []
        names = token_texts(tokenizer, [t for _, t in row])
        content.append({"token": text, "logprob": lp, "bytes": list(token_bytes(token)),
                        "top_logprobs": [{"token": nm, "logprob": tlp,
                                          "bytes": list(token_bytes(tid))}
                                         for nm, (tlp, tid) in zip(names, row)]})
    return {"content": content}


# ---------------------------------------------------------------------------------------------
# Choices and envelopes


def completion_choice(index: int, state: RequestState, body, tokenizer,
                      prompt_text: str) -> dict:
    """One choice of a whole /v1/completions answer; ``prompt_text`` is the echo, if asked."""
    logprobs = None
    if body.logprobs is not None:
        offsets = output_offsets(state, tokenizer, len(prompt_text) if body.echo else 0)
        offsets.update(state.output_token_logprobs, final=True)
        logprobs = completion_chunk_logprobs(state, body.logprobs, tokenizer, 0,
                                             offsets.offsets, prompt_text if body.echo else None)
    text = prompt_text + state.text if body.echo else state.text
    return {"index": index, "text": text, "logprobs": logprobs, **finish_fields(state)}


def chat_choice(index: int, state: RequestState, body, tokenizer, plan: ToolPlan) -> dict:
    logprobs = None
    if body.logprobs:
        logprobs = chat_logprobs(state.output_token_logprobs, state.output_top_logprobs,
                                 tokenizer)
    message = {"role": "assistant", "content": state.text}
    fields = finish_fields(state)
    if plan.parser is not None:
        content, calls = plan.parse(state.text)
        if calls:
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": [c.to_openai() for c in calls]}
            fields = tool_finish_fields(state)
    return {"index": index, "message": message, "logprobs": logprobs, **fields}


def tool_finish_fields(state: RequestState) -> dict:
    """A reply that ended in calls finishes with "tool_calls" (unless cut by a limit)."""
    fields = finish_fields(state)
    if fields["finish_reason"] == "stop":
        fields = {**fields, "finish_reason": "tool_calls"}
    return fields


def envelope(kind: str, rid: str, model: str, choices: list[dict], usage_: dict | None,
             created: int | None = None) -> dict:
    """kind: text_completion | chat.completion | chat.completion.chunk. Every chunk of one
    stream carries the same ``created`` (the stream's start) and a ``usage`` key: null but on
    the usage chunk that ``stream_options.include_usage`` adds at the end, as OpenAI's do."""
    prefix = "cmpl-" if kind == "text_completion" else "chatcmpl-"
    return {"id": prefix + rid, "object": kind,
            "created": int(time.time()) if created is None else created, "model": model,
            "choices": choices, "usage": usage_}
