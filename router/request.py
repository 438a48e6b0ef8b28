"""What the router reads from requests and responses (pure functions, no I/O).

Request side: the text the tree matches on, and the routing key for consistent_hash; both read
leniently, since the replica validates the request and names any problem.
Response side: ``cached_tokens`` and ``prompt_tokens`` for the real cache hit rate, from a JSON
body or from the last event of each answer in a server-sent-event stream, and whether a stream
that ended cleanly reported a server error in-band.

``read_request``, ``answer_counts`` and ``stream_end`` take bytes and return small results, so
the router can run them in a helper process for large bodies (bodies.py says why).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

from .policies import RequestInfo

MAX_CODEPOINT = 0x10FFFF


class BadRequest(ValueError):
    """Client error; the message starts with the offending field's name."""


# Routing text is read leniently: a field of the wrong type or value adds nothing (or stops
# the text where it goes wrong) instead of being refused, because the replica validates the
# request and names the problem in its own words; the router would only say it differently.


def _ids_to_text(ids) -> str:
    """Token ids as one character each (chr(id)), so the tree matches token prefixes exactly;
    up to the first entry that is no such id. A batch is routed by its first sequence."""
    if not isinstance(ids, list):
        return ""
    if ids and isinstance(ids[0], list):
        return _ids_to_text(ids[0])
    chars = []
    for token in ids:
        if type(token) is not int or not 0 <= token <= MAX_CODEPOINT:
            break
        chars.append(chr(token))
    return "".join(chars)


def _prompt_to_text(value) -> str:
    """``text``/``prompt``: a string, a list of strings (a batch: its first), or token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return _ids_to_text(value)


def _messages_to_text(messages) -> str:
    """Chat messages' contents, concatenated (roles and templates are left to the engine)."""
    if not isinstance(messages, list):
        return ""
    parts = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # multi-part content: keep the text parts
            parts.extend(p["text"] for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def request_text(body: dict) -> str:
    """The text the tree routes on: ``text``, ``prompt``, ``messages`` or ``input_ids`` (the
    first one present); "" when none can be read."""
    return routing_text(body)[0]


def routing_text(body: dict) -> tuple[str, bool]:
    """``request_text``, and whether it spells token ids (a prompt given as ids)."""
    for field in ("text", "prompt"):
        value = body.get(field)
        if value is not None:
            words = isinstance(value, str) or (isinstance(value, list) and bool(value)
                                               and isinstance(value[0], str))
            return _prompt_to_text(value), not words
    if body.get("messages") is not None:
        return _messages_to_text(body["messages"]), False
    if body.get("input_ids") is not None:
        return _ids_to_text(body["input_ids"]), True
    return "", False


def prompt_count(body: dict) -> int:
    """How many prompts a body holds: a batch's size (a list of strings or of id lists), else 1."""
    for field in ("text", "prompt", "input_ids"):
        value = body.get(field)
        if value is not None:
            batch = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
            return len(value) if batch else 1
    return 1


def routing_key(body: dict, headers) -> str | None:
    """``X-Routing-Key`` header, else body ``routing_key``, else body ``session_id`` (a string
    or an integer; another type is no key, and /generate's replica names it)."""
    key = headers.get("x-routing-key")
    if key:
        return key
    for field in ("routing_key", "session_id"):
        value = body.get(field)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    return None


def copies_per_prompt(body: dict) -> int | tuple[int, ...]:
    """For a native /generate body: how many copies (``n``) of each prompt its answer holds, one
    number for every prompt or, with ``sampling_params`` given per prompt, one per prompt.

    A replica (and SGLang) answers a batch or n > 1 with one result per copy, prompt-major
    (prompt p's copies side by side; streamed events carry that index), and every copy reports
    its prompt's prompt and cached tokens: counting the first copy only counts a prompt once,
    whatever n, as OpenAI's ``usage`` does. 1 (each result a prompt of its own) when an ``n``
    cannot be read: the replica refuses such a body."""
    params = body.get("sampling_params")
    if not isinstance(params, list):
        return _copies(params) or 1
    copies = tuple(_copies(p) for p in params)
    return copies if None not in copies and any(n != 1 for n in copies) else 1


def _copies(params) -> int | None:
    """``n`` of one prompt's sampling params (default 1); None if it is no valid count."""
    if params is None:
        return 1
    if not isinstance(params, dict):
        return None
    n = params.get("n")
    if n is None:
        return 1
    return n if type(n) is int and n >= 1 else None


def read_request(raw: bytes, header_key: str | None, native: bool) -> RequestInfo:
    """What the router needs of a generation request's body (its routing text and key, whether
    it streams, and for native requests ``copies_per_prompt``); BadRequest, worded as a replica
    words it, for a body it cannot route: not JSON, or not a JSON object. ``header_key`` is
    the request's X-Routing-Key header."""
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nested too deep
        raise BadRequest(f"body: malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    key = routing_key(body, {"x-routing-key": header_key} if header_key else {})
    text, by_ids = routing_text(body)
    return RequestInfo(text, key, body.get("stream") is True,
                       copies_per_prompt(body) if native else 1, by_ids,
                       body.get("continue_final_message") is True, prompt_count(body))


def token_counts(obj) -> tuple[int, int] | None:
    """(cached_tokens, prompt_tokens) from a response object (or a list of them), or None.

    Native responses carry ``meta_info``; OpenAI ones ``usage`` with
    ``prompt_tokens_details.cached_tokens``.
    """
    if isinstance(obj, list):
        found = [c for c in map(token_counts, obj) if c is not None]
        if not found:
            return None
        return sum(c for c, _ in found), sum(p for _, p in found)
    if not isinstance(obj, dict):
        return None
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("prompt_tokens"), int):
        return int(meta.get("cached_tokens") or 0), meta["prompt_tokens"]
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return int(cached or 0), usage["prompt_tokens"]
    return None


def prompt_counts(results: dict, copies: int | tuple[int, ...]) -> tuple[int, int] | None:
    """(cached, prompt) tokens of the answers in ``results`` (index -> answer object; None:
    an answer without index), each prompt once: of its ``copies`` (``copies_per_prompt``) only
    the first counts."""
    if isinstance(copies, int):
        counted = [obj for i, obj in results.items() if i is None or i % copies == 0]
    else:
        firsts = set(accumulate(copies[:-1], initial=0))
        counted = [obj for i, obj in results.items() if i is None or i in firsts]
    return token_counts(counted)


def answer_counts(raw: bytes, copies: int | tuple[int, ...]) -> tuple[int, int] | None:
    """``prompt_counts`` of a whole JSON answer (one object, or a list for a batch or n > 1)."""
    return answer_facts(raw, copies)[0]


def answer_facts(raw: bytes, copies: int | tuple[int, ...], by_ids: bool = False
                 ) -> tuple[tuple[int, int] | None, list[str]]:
    """``answer_counts`` and ``answer_texts`` of a whole JSON answer, parsed once. A native list
    is learned from only when it holds one prompt's copies (a batch's other prompts are not
    in the routing text)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None, []  # not JSON: nothing to learn about the cache
    if not isinstance(obj, list):
        return prompt_counts({None: obj}, 1), answer_texts(obj, by_ids)
    texts = [t for o in obj for t in answer_texts(o, by_ids)] if len(obj) == copies else []
    fits = len(obj) % copies == 0 if isinstance(copies, int) else len(obj) == sum(copies)
    if not fits:
        copies = 1  # not the layout the request asked for: count what came
    return prompt_counts(dict(enumerate(obj)), copies), texts


def answer_texts(obj, by_ids: bool = False) -> list[str]:
    """The text each choice of one answer generated: native ``text`` (its ``output_ids`` when
    the prompt was token ids), a completion's ``choices[i].text``, a chat reply's
    ``choices[i].message.content``. The engine caches each after the prompt, so a
    conversation's next turn starts with the prompt and one of them."""
    if not isinstance(obj, dict):
        return []
    if isinstance(obj.get("meta_info"), dict):
        text = _ids_to_text(obj.get("output_ids")) if by_ids else obj.get("text")
        return [text] if isinstance(text, str) and text else []
    choices = obj.get("choices")
    if by_ids or not isinstance(choices, list):  # an OpenAI answer spells no token ids
        return []
    texts = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        text = message.get("content") if isinstance(message, dict) else (
            choice.get("text") if isinstance(choice, dict) else None)
        if isinstance(text, str) and text:
            texts.append(text)
    return texts


def answer_route_texts(route: str, info: RequestInfo, answers: list[str]) -> list[str]:
    """The texts a conversation's next turn may start with: the request's routing text, then
    one of its answers, joined as ``request_text`` joins chat messages (by a newline, none
    when the answer continues the last message). A completion's echo (the prompt again, in
    front of the answer) is dropped. Nothing for a batch: its routing text is its first prompt."""
    if info.prompts != 1:
        return []
    prompt = info.text
    joint = "\n" if route == "/v1/chat/completions" and not info.continues else ""
    texts = []
    for answer in answers:
        if route == "/v1/completions" and answer.startswith(prompt):
            answer = answer[len(prompt):]
        if answer and prompt:
            texts.append(prompt + joint + answer)
    return texts


def stream_texts(events: list[bytes], by_ids: bool = False) -> list[str]:
    """``answer_texts`` of a whole stream: given a native stream's last event of each answer
    (each holds its text so far), or every event of an OpenAI stream (each carries a piece of
    its choice's text)."""
    payloads = [p for p in map(_event_json, events) if isinstance(p, dict)]
    if payloads and all(isinstance(p.get("meta_info"), dict) for p in payloads):
        return [t for p in payloads for t in answer_texts(p, by_ids)]
    if by_ids:
        return []
    pieces: dict[int, list[str]] = {}
    for p in payloads:
        choices = p.get("choices")
        if not isinstance(choices, list):
            return []
        for choice in choices:
            index = choice.get("index", 0) if isinstance(choice, dict) else None
            if type(index) is not int:
                return []
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str):
                pieces.setdefault(index, []).append(piece)
    return ["".join(p) for p in pieces.values() if p]


def answer_events(route: str, tail: SSETail, copies: int | tuple[int, ...]
                  ) -> list[bytes] | None:
    """The events ``stream_texts`` reads: every event of an OpenAI stream (None past the cap),
    the last event of each copy of a native stream's one prompt (None for a batch)."""
    if route != "/generate":
        return tail.events
    last = tail.last_events
    one_prompt = set(last) == {None} or (isinstance(copies, int)
                                         and set(last) == set(range(copies)))
    return list(last.values()) if one_prompt else None


def server_error(obj) -> int | None:
    """The status of a server error a stream event reports in-band, else None: an error event
    with a ``code`` >= 500 (a /v1 stream reports an abort this way, a native one a crash), or a
    native answer aborted with ``status_code`` >= 500 (its engine failed under it). Aborts that
    are the client's doing carry no such status."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("error"), dict):
        code = obj["error"].get("code")
    elif obj.get("object") == "error":
        code = obj.get("code")
    else:
        meta = obj.get("meta_info")
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        aborted = isinstance(reason, dict) and reason.get("type") == "abort"
        code = reason.get("status_code") if aborted else None
    return code if type(code) is int and code >= 500 else None


def stream_end(events: dict, copies: int | tuple[int, ...]):
    """From the last event of each answer of a stream (``SSETail.last_events``): its
    ``prompt_counts``, and the status of a server error it ended with (None: it did not)."""
    payloads = {key: _event_json(event) for key, event in events.items()}
    failed = next((code for code in map(server_error, payloads.values()) if code), None)
    return prompt_counts(payloads, copies), failed


def _event_json(event: bytes):
    """An SSE event's JSON payload (its data lines joined), or None."""
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    try:
        return json.loads(b"\n".join(lines)) if lines else None
    except (ValueError, RecursionError):
        return None


# A native stream of several answers (a batch, or n > 1) interleaves their events, each object
# carrying its answer's ``index`` as its last key (the replica and SGLang add it last). Reading
# it off the event's end keeps the bytes unparsed while they pass: parsing every event of every
# stream would cost the router more than relaying it. An event where it is not last counts as
# an answer without index (the stream is then judged by its last such event, as before).
KEEP_EVENTS_BYTES = 256 << 10  # per stream: ~1,500 tokens of chat, learned in full
_INDEX_AT_END = re.compile(rb'"index"\s*:\s*(\d+)\s*\}\s*$')


class SSETail:
    """Remembers the last ``data:`` event (other than [DONE]) of each answer in a stream, while
    the bytes pass through untouched: one event per answer index, and the unfinished one.
    With ``keep_events`` it also keeps every event (for ``stream_texts``) until they pass
    ``KEEP_EVENTS_BYTES``; then ``events`` is None."""

    def __init__(self, keep_events: bool = False):
        self._partial = b""
        self.last_events: dict[int | None, bytes] = {}
        self.size = 0  # bytes held in last_events
        self.done = False  # the stream's closing "data: [DONE]" went by
        self.events: list[bytes] | None = [] if keep_events else None
        self.events_size = 0

    def feed(self, chunk: bytes) -> None:
        buf = self._partial + chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._partial = buf
            return
        complete, self._partial = buf[:end], buf[end + 2:]
        for event in complete.split(b"\n\n"):
            if event.strip() == b"data: [DONE]":
                self.done = True
                continue
            if b"data:" not in event:
                continue
            match = _INDEX_AT_END.search(event[-64:])
            key = int(match[1]) if match else None
            self.size += len(event) - len(self.last_events.get(key, b""))
            self.last_events[key] = event
            if self.events is not None:
                self.events_size += len(event)
                self.events.append(event)
                if self.events_size > KEEP_EVENTS_BYTES:
                    self.events = None  # too long an answer to learn; the prompt is known
