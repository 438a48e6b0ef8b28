"""When a request is done: length limits, EOS, stop token ids, stop strings and stop regexes.

Stop strings are matched on text, and a stop string may span several tokens, so the check
decodes the tail of the output: ``UTF-8 bytes of the longest stop string + 1`` tokens cover
any stop string that ends in the newest token, since every token holds at least one byte
(byte-level BPE splits ``→`` into three). A stop regex (``stop_regex``, searched with the
``regex`` module) gets the same window from the longest text it can match, at 4 bytes per
character; one without a bound (``\\d+``, ``.*``) searches the whole output.
``min_new_tokens`` holds off EOS and ``stop_token_ids`` (the sampler masks them), not stop
strings or regexes, as in SGLang: the HTTP detokenizer matches those on the text from its
first token, and so does this check.
``trim_stop_text`` removes the matched stop from the text a client sees (unless
``no_stop_trim``); the token ids are kept as generated.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Callable, Iterable

import regex

try:
    from re import _parser as sre_parse  # the standard library's regex parser (3.11+)
except ImportError:  # Python 3.10
    import sre_parse

from .request import FinishReason, Req

log = logging.getLogger(__name__)

# decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...), as the tokenizer's:
# the stop check reads the text the client gets (a hidden special token is not in it)
Decode = Callable[..., str]
# Tokens decoded before a stop regex's window, searched from the window on: a lookbehind or \b
# then sees the real text before it, and ^ does not match at the window's first token.
STOP_REGEX_CONTEXT_TOKENS = 8
REPLACEMENT_CHAR = "\ufffd"  # what a token ending inside a UTF-8 character decodes to
_UNBOUNDED = 1 << 16  # a match width from here on counts as unbounded
# Stop regexes are searched at every token, on the engine's thread and on the HTTP event loop,
# where their time stalls every request on the replica (a crafted pattern froze one for good;
# twenty patterns just under any per-search limit slowed everyone 5x). So each request has a
# budget of search time on each side that searches (the scheduler's check, the HTTP
# detokenizer): one that spends it ends with a 400, the rest of the replica unharmed.
STOP_REGEX_BUDGET_S = 1.0


class StopRegexTooSlow(ValueError):
    """A request's stop regexes spent their search time; the message names the field."""


class RegexBudget:
    """The stop-regex search time one request has left on one side (mutated by ``search``)."""

    def __init__(self, seconds: float = STOP_REGEX_BUDGET_S):
        self.left = seconds

    def search(self, pattern: str, text: str, pos: int, partial: bool = False):
        if self.left <= 0:
            raise self._spent(pattern)
        started = time.perf_counter()
        try:
            return compile_stop_regex(pattern).search(text, pos, partial=partial,
                                                      timeout=self.left)
        except TimeoutError:
            self.left = 0
            raise self._spent(pattern) from None
        finally:
            self.left -= time.perf_counter() - started

    @staticmethod
    def _spent(pattern: str) -> StopRegexTooSlow:
        return StopRegexTooSlow(f"stop_regex: searching for {pattern!r} and the request's other "
                                f"stop regexes took over {STOP_REGEX_BUDGET_S:g} s; use "
                                "simpler patterns")


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


@functools.lru_cache(maxsize=1024)
def stop_regex_width(pattern: str) -> int | None:
    """The most characters a match of ``pattern`` spans; None if unbounded or unknown (syntax
    only the ``regex`` module reads), and then the whole output is searched."""
    try:
        width = sre_parse.parse(pattern).getwidth()[1]
    except Exception:  # noqa: BLE001 - any parse failure means "unknown"
        return None
    return width if width < _UNBOUNDED else None


def find_stop(text: str, start: int, stop: Iterable[str], stop_regex: Iterable[str],
              budget: RegexBudget | None = None) -> tuple[int, int, str] | None:
    """The earliest stop in ``text[start:]`` as (start, end, the stop string or regex), or None.
    ``budget``: the request's regex search time (None: a fresh one)."""
    budget = budget or RegexBudget()
    best = None
    for s in stop:
        pos = text.find(s, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, pos + len(s), s)
    for pattern in stop_regex:
        m = budget.search(pattern, text, start)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), m.end(), pattern)
    return best


def regex_holdback(text: str, start: int, stop_regex: Iterable[str],
                   budget: RegexBudget | None = None) -> int:
    """How much of the end of ``text[start:]`` may still grow into a match of a stop regex
    (its partial match: the ``regex`` module's ``partial=True``), so must not be released."""
    budget = budget or RegexBudget()
    longest = 0
    for pattern in stop_regex:
        m = budget.search(pattern, text, start, partial=True)
        if m is not None and m.partial:
            longest = max(longest, len(text) - m.start())
    return longest


CONTEXT_TOKENS = 4  # prompt tokens decoded in front of an output's first tokens


def decode_context(decode, prompt_ids) -> list[int]:
    """The prompt's last few tokens, to decode an output after: a SentencePiece tokenizer
    (Llama 2, Mistral) drops the leading space of a decode's first word (" is ok" decoded
    alone reads "is ok"). [] when they end inside a character (their text would not be a
    prefix of the joined text)."""
    context = list(prompt_ids[-CONTEXT_TOKENS:])
    return [] if decode(context).endswith(REPLACEMENT_CHAR) else context


def decode_after(decode, context: list[int], ids: list[int]) -> str:
    """``decode(ids)`` as the text that follows ``context`` (``decode_context``)."""
    if not context:
        return decode(ids)
    before, joined = decode(context), decode(context + list(ids))
    return joined[len(before):] if joined.startswith(before) else decode(ids)


class StopChecker:
    def __init__(self, eos_token_ids: Iterable[int] = (), decode: Decode | None = None,
                 max_context_len: int | None = None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode
        self.max_context_len = max_context_len
        self._budgets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Req -> budget

    def check(self, req: Req) -> FinishReason | None:
        """Why ``req`` is finished after its newest token, or None. Reads only; the caller sets
        ``req.finish_reason``. A stop token or string completed by the last allowed token is a
        stop, not a length finish (OpenAI's and vLLM's meaning; SGLang checks length first): the
        HTTP detokenizer, which finds stop strings in the full text, reports the same.

        Runs in the scheduler's loop, where an exception would stop the engine and fail every
        request: stop parameters that the API's checks let through but that fail here (a
        string that is not valid Unicode, say) end only their own request, with a 400."""
        try:
            return self._check(req)
        except StopRegexTooSlow as e:
            return FinishReason.abort(str(e), status_code=400)
        except Exception as e:  # noqa: BLE001 (any failure here is this request's own)
            log.exception("request %s: checking its stop conditions failed", req.rid)
            return FinishReason.abort(f"stop: cannot check this request's stop conditions "
                                      f"({type(e).__name__}: {e})", status_code=400)

    def _check(self, req: Req) -> FinishReason | None:
        sp, out = req.sampling_params, req.output_ids
        last = out[-1]
        if len(out) >= sp.min_new_tokens and (
                last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids)):
            return FinishReason.stop(last)
        if (sp.stop or sp.stop_regex) and self.decode is None:
            raise ValueError("stop: stop strings need a tokenizer to decode with")
        if sp.stop:
            start = max(len(out) - max(len(s.encode()) for s in sp.stop) - 1, 0)
            # a window's edges may cut a character (U+FFFD): no stop may match that
            tail = self._text(req, sp, start, len(out)).strip(REPLACEMENT_CHAR)
            for s in sp.stop:
                if s in tail:
                    return FinishReason.stop(s)
        if sp.stop_regex:
            matched = self._stop_regex_match(req, out, sp)
            if matched is not None:
                return FinishReason.stop(matched)
        if len(out) >= sp.max_new_tokens:
            return FinishReason.of_length(len(out))
        if self.max_context_len is not None and req.total_len >= self.max_context_len:
            return FinishReason.of_length(len(out))
        return None

    def _text(self, req: Req, sp, start: int, end: int) -> str:
        """The text of ``req.output_ids[start:end]``; from the first token on, decoded after
        the prompt's last tokens (``decode_context``: a SentencePiece answer keeps its
        leading space)."""
        decode = functools.partial(self.decode, skip_special_tokens=sp.skip_special_tokens,
                                   spaces_between_special_tokens=sp.spaces_between_special_tokens)
        ids = req.output_ids[start:end]
        if start:
            return decode(ids)
        return decode_after(decode, decode_context(decode, req.origin_input_ids), ids)

    def _stop_regex_match(self, req: Req, out: list[int], sp) -> str | None:
        """The first stop regex that matches the output's newest text, or None. Searched from
        a window of tokens wide enough for the longest match (4 bytes a character; all of the
        output for an unbounded pattern), with a few tokens of context before it."""
        widths = [stop_regex_width(p) for p in sp.stop_regex]
        window = len(out) if None in widths else 4 * max(widths) + 1
        start = max(len(out) - window - STOP_REGEX_CONTEXT_TOKENS, 0)
        # the newest token ends inside a character: wait for the rest (as the HTTP
        # detokenizer does), or a \W would match its replacement character
        text = self._text(req, sp, start, len(out)).rstrip(REPLACEMENT_CHAR)
        pos = len(self._text(req, sp, start, len(out) - window)) if len(out) > window else 0
        budget = self._budgets.get(req)
        if budget is None:
            budget = self._budgets[req] = RegexBudget()
        for p in sp.stop_regex:
            if budget.search(p, text, pos):
                return p
        return None


def trim_stop_text(text: str, finish_reason: FinishReason | None, no_stop_trim: bool,
                   stop_regex: Iterable[str] = ()) -> str:
    """The output text a client sees: cut just before a matched stop string or where the
    matched stop regex (one of ``stop_regex``) first matches."""
    if no_stop_trim or finish_reason is None or not isinstance(finish_reason.matched, str):
        return text
    matched = finish_reason.matched
    is_regex = matched in stop_regex
    found = find_stop(text, 0, () if is_regex else [matched], [matched] if is_regex else ())
    return text if found is None else text[:found[0]]


def visible_output_ids(output_ids: list[int], finish_reason: FinishReason | None,
                       no_stop_trim: bool) -> list[int]:
    """The ids to detokenize for the client's text: a matched stop token is not shown."""
    if (not no_stop_trim and finish_reason is not None and finish_reason.type == "stop"
            and isinstance(finish_reason.matched, int) and output_ids
            and output_ids[-1] == finish_reason.matched):
        return output_ids[:-1]
    return output_ids
