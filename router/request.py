"""What the router reads from requests and responses (pure functions, no I/O).

Request side: the text the tree matches on, and the routing key for consistent_hash; both read
leniently, since the replica validates the request and names any problem.
Response side: ``cached_tokens`` and ``prompt_tokens`` for the real cache hit rate, from a JSON
body or from the last event of a server-sent-event stream.
"""

from __future__ import annotations

import json

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
    for field in ("text", "prompt"):
        if body.get(field) is not None:
            return _prompt_to_text(body[field])
    if body.get("messages") is not None:
        return _messages_to_text(body["messages"])
    if body.get("input_ids") is not None:
        return _ids_to_text(body["input_ids"])
    return ""


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


class SSETail:
    """Remembers the last ``data:`` event of a stream (other than [DONE]) while the bytes pass
    through untouched; keeps only the last complete event and the unfinished one."""

    def __init__(self):
        self._partial = b""
        self.last_event = b""

    def feed(self, chunk: bytes) -> None:
        buf = self._partial + chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._partial = buf
            return
        complete, self._partial = buf[:end], buf[end + 2:]
        # [DONE] ends a stream and may share a chunk with the event we want: look at two.
        for event in reversed(complete.rsplit(b"\n\n", 2)[-2:]):
            if b"data:" in event and event.strip() != b"data: [DONE]":
                self.last_event = event
                break

    def last_json(self):
        """The last event's JSON payload, or None."""
        lines = [line[5:].strip() for line in self.last_event.split(b"\n")
                 if line.startswith(b"data:")]
        if not lines:
            return None
        try:
            return json.loads(b"\n".join(lines))
        except ValueError:
            return None
