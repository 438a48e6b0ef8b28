"""Incremental detokenization with stop strings.

A request's output arrives a few token ids at a time; the client wants text a piece at a time.
Two things make that harder than decoding each new token on its own:

- A byte-level token can hold part of a UTF-8 character. Decoding a window that ends inside a
  character yields U+FFFD, so text is released only once the window decodes cleanly (the
  "prefix/read offset" scheme): ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``.
- A stop string may arrive split over several tokens. Text that could still become the start
  of a stop string is held back until it either completes the stop (then it is cut off and the
  stream ends) or can no longer match (then it is released). Stop regexes alike: text that a
  regex matches partially (up to its end) is held back.

- A SentencePiece tokenizer (Llama 2, Mistral) drops the leading space of a decode's first
  word: decoded alone, an answer " is ok" reads "is ok". The first window therefore starts
  with the prompt's last few tokens (``scheduler.stop.decode_context``), whose text is then
  cut off again.

The non-streamed response uses the same object, so the concatenation of the streamed pieces is
the non-streamed text by construction; for byte-level tokenizers both equal
``tokenizer.decode(output_ids)`` (tested).
"""

from __future__ import annotations

import functools
import json
import os
import re
import weakref

from ..scheduler.stop import (REPLACEMENT_CHAR, DecodeWindow, RegexBudget, find_stop,
                              regex_holdback)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into released text.

    ``add`` and ``finish`` return the newly released text; ``text`` is everything released so
    far; ``matched_stop`` is the stop string (or stop regex) that ended the output (then
    further ids are ignored).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, no_stop_trim: bool = False,
                 stop_regex: list[str] | None = None,
                 spaces_between_special_tokens: bool = True, prompt_ids=()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # honoured by slow (Python) tokenizers; fast ones never add such spaces
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.stop_regex = list(stop_regex or [])
        self._regex_budget = RegexBudget()  # this request's search time (scheduler.stop)
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []  # the output ids
        self._window = DecodeWindow(self._decode, prompt_ids)
        self.text = ""  # released
        self.matched_stop: str | None = None
        self._decoded = ""  # clean decoded text of the committed ids, released or held back

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the text that is now safe to send (may be "")."""
        if self.matched_stop is not None:
            return ""
        self.ids.extend(token_ids)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The output ended: release everything still held (a trailing partial character is
        decoded as U+FFFD, as a full decode would) unless a stop string already ended it."""
        if self.matched_stop is not None:
            return ""
        self._advance(final=True)
        return self._release(final=True)

    def _advance(self, final: bool) -> None:
        if self._window.read < len(self.ids):
            self._decoded += self._window.advance(self.ids, final)[0]

    def _release(self, final: bool) -> str:
        sent = len(self.text)
        end = len(self._decoded)
        # A stop cannot begin before `sent`: any text that could begin one was held back.
        found = find_stop(self._decoded, sent, self.stop, self.stop_regex, self._regex_budget)
        if found is not None:
            pos, _, self.matched_stop = found
            # no_stop_trim keeps all the text decoded so far, the rest of the token that
            # completed the stop included (as SGLang, and the offline Engine, return it)
            end = len(self._decoded) if self.no_stop_trim else pos
        elif not final:
            end -= self._holdback(sent)
        piece = self._decoded[sent:end]
        self.text += piece
        return piece

    def _holdback(self, start: int) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of a stop string, or
        that a stop regex matches partially."""
        tail = self._decoded[start:]
        longest = regex_holdback(self._decoded, start, self.stop_regex, self._regex_budget)
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:k]):
                    longest = k
                    break
        return longest


_token_text_memo: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer: {id: text}


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token decoded on its own (special tokens kept), for logprob entries. Memoised per
    tokenizer: a streamed answer's top-k rows name the same tokens over and over, and a
    decode call costs tens of microseconds (top-20 logprobs: 45-60 us per token, each chunk)."""
    try:
        memo = _token_text_memo.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
        memo = {}
    texts = []
    for t in token_ids:
        text = memo.get(t)
        if text is None:
            text = memo[t] = tokenizer.decode([t], skip_special_tokens=False)
        texts.append(text)
    return texts


def text_offsets(tokenizer, token_ids: list[int], start: int = 0,
                 skip_special_tokens: bool = True) -> list[int]:
    """Where each token's text begins in ``decode(token_ids)`` (shifted by ``start``).

    Tokens are decoded in windows that end on a whole character, as the detokenizer releases
    text, so the offsets never drift by the U+FFFD a lone partial token decodes to: a token
    that continues a character begins where the character begins. A special token is
    zero-width when ``skip_special_tokens`` (it is not in the text), else as wide as its name.
    """
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if ids else ""

    offsets, window, position = [], [], start
    for i, token in enumerate(token_ids):
        window.append(token)
        text = decode(window)
        if text.endswith(REPLACEMENT_CHAR) and i + 1 < len(token_ids):
            continue  # may end inside a character: wait for the next token
        # A token begins where its window's text stops agreeing with the text before it
        # ("\ufffd" for a partial character, which the whole window turns into the character).
        offsets += [position + len(os.path.commonprefix([decode(window[:k]), text]))
                    for k in range(len(window))]
        position += len(text)
        window = []
    return offsets


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table (transformers'), which byte-level BPE
    vocabularies are written in."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # older transformers
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}

_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


class TokenBytes:
    """A token's raw bytes (OpenAI logprobs' ``bytes``), which for a token holding part of a
    UTF-8 character are not the bytes of its decoded text (U+FFFD). How vocabulary strings
    map to bytes is read from the tokenizer once: byte-level BPE (GPT-2's alphabet),
    SentencePiece ("<0xHH>" byte tokens, "\u2581" for a space), else the decoded text. Added
    and special tokens are their text's UTF-8. Use ``TokenBytes.of(tokenizer)``."""

    _by_tokenizer: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.scheme = _vocabulary_scheme(tokenizer)
        self.added = {i: t.content for i, t in
                      (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._memo: dict[int, bytes] = {}

    @classmethod
    def of(cls, tokenizer) -> "TokenBytes":
        try:
            found = cls._by_tokenizer.get(tokenizer)
            if found is None:
                found = cls._by_tokenizer[tokenizer] = cls(tokenizer)
            return found
        except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
            return cls(tokenizer)

    def __call__(self, token_id: int) -> bytes:
        found = self._memo.get(token_id)
        if found is None:
            found = self._memo[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            alphabet = byte_level_alphabet()
            if self.scheme == "byte_level" and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            if self.scheme == "sentencepiece":
                byte = _SENTENCEPIECE_BYTE.fullmatch(piece)
                if byte:
                    return bytes([int(byte[1], 16)])
                return piece.replace(SENTENCEPIECE_SPACE, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _vocabulary_scheme(tokenizer) -> str:
    """byte_level | sentencepiece | text, from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (AttributeError, TypeError, ValueError):
        return "text"
    kinds = {d.get("type") for d in [decoder, *(decoder.get("decoders") or [])]
             if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "text"
