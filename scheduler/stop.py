"""When a request is done: length limits, EOS, stop token ids, stop strings and stop regexes.

Stop strings are matched on text, and a stop string may span several tokens, so the check
decodes the tail of the output: ``UTF-8 bytes of the longest stop string + 1`` tokens cover
any stop string that ends in the newest token, since every token holds at least one byte
(byte-level BPE splits ``→`` into three). A stop regex (``stop_regex``, searched with the
``regex`` module) is searched over the whole output's text, which is decoded incrementally
(as the HTTP detokenizer decodes it) and searched only from where a match may still start:
the start of the last partial match, else the newest text. A token so costs the search of
its own text, not of the whole output (which spent a request's search budget in ~30k tokens),
except while a partial match stays open: after ``<a>``, ``(?s)<a>.*</a>`` is searched from
there at every token, and such a request may still spend its budget in a long answer.
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

from .request import FinishReason, Req

log = logging.getLogger(__name__)

# decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...), as the tokenizer's:
# the stop check reads the text the client gets (a hidden special token is not in it)
Decode = Callable[..., str]
# Characters of output text kept before where a stop regex's search resumes: what a lookbehind
# or \b may look back on (older text is dropped, so a request keeps a bounded text).
STOP_REGEX_LOOKBEHIND_CHARS = 1024
STOP_REGEX_RESCAN_CHARS = 64  # see _RegexScan.match (less than the lookbehind kept)
REPLACEMENT_CHAR = "\ufffd"  # what a token ending inside a UTF-8 character decodes to
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


class DecodeWindow:
    """The text of a growing list of output ids, decoded a window at a time as the HTTP
    detokenizer releases it: ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``,
    committed once it ends on a whole character, so each step decodes a few tokens, not the
    whole output. The first window follows the prompt's last tokens (``decode_context``),
    so the output's first word joins the prompt's text as a whole decode joins it."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids=()):
        self.decode = decode
        self.context = decode_context(decode, prompt_ids) if prompt_ids else []
        self.prefix = self.read = 0  # output ids [prefix, read): the last committed window

    def advance(self, out: list[int], final: bool = False) -> tuple[str, str]:
        """``(committed, pending)`` for ``out`` (the whole output so far): the text its new
        ids commit, and (when nothing is committed) the text decoded past the committed text,
        less the U+FFFD of a character cut at the end. ``final``: commit even a cut one."""
        before = self.decode(self.context + out[self.prefix:self.read])
        after = self.decode(self.context + out[self.prefix:])
        if self.context and not after.startswith(before):
            # the prompt's text changed once the output followed it (a tokenizer's clean-up of
            # spaces): decode the output alone, as decode_after does then (prefix == read == 0)
            self.context, before, after = [], "", self.decode(out)
        # a special token skipped on decode adds nothing and simply stays in the next window
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT_CHAR)):
            self.prefix, self.read, self.context = self.read, len(out), []
            return after[len(before):], ""
        return "", after[len(before):].rstrip(REPLACEMENT_CHAR)


class StopChecker:
    def __init__(self, eos_token_ids: Iterable[int] = (), decode: Decode | None = None,
                 max_context_len: int | None = None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode
        self.max_context_len = max_context_len
        self._scans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Req -> _RegexScan

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
        """The first stop regex (in ``sp.stop_regex``'s order) that matches the output's text,
        or None. The text is decoded incrementally and each pattern is searched from where a
        match of it may still start (``_RegexScan``)."""
        scan = self._scans.get(req)
        if scan is None or len(out) < scan.seen:  # new, or its output was cut: start over
            budget = scan.budget if scan is not None else RegexBudget()
            decode = functools.partial(
                self.decode, skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens)
            scan = self._scans[req] = _RegexScan(decode, req.origin_input_ids,
                                                 len(sp.stop_regex), budget)
        return scan.match(out, sp.stop_regex)


class _RegexScan:
    """One request's stop-regex search state. ``text`` is the output's committed text from
    char ``base`` on (``DecodeWindow``, as the HTTP detokenizer decodes it), so it only ever
    grows at its end; ``resume[i]`` is the first char where a match of pattern i may still
    start: no match of it can start before, whatever text follows."""

    def __init__(self, decode, prompt_ids, num_patterns: int, budget: RegexBudget):
        self.window, self.budget = DecodeWindow(decode, prompt_ids), budget
        self.text, self.base = "", 0
        self.resume = [0] * num_patterns
        self.seen = 0  # output tokens read so far

    def match(self, out: list[int], patterns: list[str]) -> str | None:
        pending = ""
        if len(out) > self.window.read:
            # text cut inside a character waits for the rest (as the HTTP detokenizer waits),
            # or \W would match its U+FFFD
            committed_now, pending = self.window.advance(out)
            self.text += committed_now
        self.seen = len(out)
        text = self.text + pending if pending else self.text
        committed = len(self.text)  # chars of `text` that later text only extends
        for i, pattern in enumerate(patterns):
            if compile_stop_regex(pattern).flags & regex.REVERSE:
                # searched backwards (?r): its partial matches say nothing about where a match
                # may start, so it is searched from the output's start each time
                if self.budget.search(pattern, text, self.resume[i] - self.base):
                    return pattern
                continue
            # a partial match runs to the end of the text: more text may complete it, so the
            # next search starts there; no match at all: none can start in the committed text
            # (the uncommitted rest only grows too: what a cut character hides is stripped)
            pos = self.resume[i] - self.base
            m = self.budget.search(pattern, text, pos, partial=True)
            if m is not None and not m.partial:
                return pattern
            if m is not None:
                # a full match may still begin at or after it (which of the two a search
                # with partial=True reports first is not documented): look for one
                if self.budget.search(pattern, text, m.start()) is not None:
                    return pattern
                start = min(m.start(), committed)
            else:
                start = committed
            # A match cut by the end at a zero-width assertion (foo\B, a(?!$)) is reported as
            # a partial match that starts at the end, not at its real start: search again a
            # little before the point found (a search from earlier only costs more).
            self.resume[i] = self.base + max(pos, start - STOP_REGEX_RESCAN_CHARS)
        # Drop text no search needs: all but STOP_REGEX_LOOKBEHIND_CHARS before the earliest
        # resume (at least that many at once, so the copies add up to O(text)). Kept text
        # never starts at a search's start, so ^ and \A still match only at the output's start.
        cut = min(self.resume, default=0) - STOP_REGEX_LOOKBEHIND_CHARS
        if cut - self.base >= STOP_REGEX_LOOKBEHIND_CHARS:
            self.text, self.base = self.text[cut - self.base:], cut
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
