"""What the router reads from requests and responses (pure functions, no I/O).

Request side: the text the tree matches on, and the routing key for consistent_hash.
Response side: ``cached_tokens`` and ``prompt_tokens`` for the real cache hit rate, from a JSON
body or from the last event of a server-sent-event stream.
"""

from __future__ import annotations

import json

MAX_CODEPOINT = 0x10FFFF


class BadRequest(ValueError):
    """Client error; the message starts with the offending field's name."""


def _ids_to_text(ids, field: str) -> str:
    """Token ids as one character each (chr(id)), so the tree matches token prefixes exactly."""
    if not isinstance(ids, list):
        raise BadRequest(f"{field}: must be a list of token ids")
    if ids and isinstance(ids[0], list):  # a batch: routed by its first sequence
        return _ids_to_text(ids[0], field)
    try:
        return "".join(map(chr, ids))
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{field}: token ids must be integers in [0, {MAX_CODEPOINT}]") from None


def _prompt_to_text(value, field: str) -> str:
    """``text``/``prompt``: a string, a list of strings (a batch), or token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            return ""
        first = value[0]
        if isinstance(first, str):
            return first  # a batch is routed by its first prompt
        if isinstance(first, (int, list)) and not isinstance(first, bool):
            return _ids_to_text(value, field)
    raise BadRequest(f"{field}: must be a string, a list of strings or a list of token ids")


def _messages_to_text(messages) -> str:
    """Chat messages' contents, concatenated (roles and templates are left to the engine)."""
    if not isinstance(messages, list):
        raise BadRequest("messages: must be a list of {role, content} objects")
    parts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}]: must be an object with role and content")
        content = msg.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # multi-part content: keep the text parts
            parts.extend(p["text"] for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
        elif content is not None:
            raise BadRequest(f"messages[{i}].content: must be a string or a list of parts")
    return "\n".join(parts)


def request_text(body: dict) -> str:
    """The text the tree routes on: ``text``, ``prompt``, ``messages`` or ``input_ids``."""
    for field in ("text", "prompt"):
        if body.get(field) is not None:
            return _prompt_to_text(body[field], field)
    if body.get("messages") is not None:
        return _messages_to_text(body["messages"])
    if body.get("input_ids") is not None:
        return _ids_to_text(body["input_ids"], "input_ids")
    return ""


def routing_key(body: dict, headers) -> str | None:
    """``X-Routing-Key`` header, else body ``routing_key``, else body ``session_id``."""
    key = headers.get("x-routing-key")
    if key:
        return key
    for field in ("routing_key", "session_id"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
        raise BadRequest(f"{field}: must be a string")
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
