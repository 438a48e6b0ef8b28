"""Constrained decoding with xgrammar: asynchronous compilation, per-request matchers, batch
token masks, and jump-forward with boundary re-tokenization.

- ``GrammarBackend`` compiles ``(kind, text)`` grammars on a small thread pool. ``submit``
  returns a ``GrammarFuture`` at once; the scheduler polls ``done()`` and never waits.
  Compiled grammars are cached by ``(kind, text)``, and concurrent submits of one grammar share
  one compilation. ``validate_grammar`` is the cheap synchronous check for the HTTP layer: it
  parses without the tokenizer-dependent compilation (well under a millisecond).
- ``GrammarState`` is one request's matcher over its output tokens: it fills its row of the
  token bitmask, accepts sampled tokens, and computes jump-forward extensions.
- ``MaskFiller`` / ``allocate_vocab_mask`` build the batch bitmask ``[B, ceil(V/32)]`` int32 in
  xgrammar's layout (bit ``j`` of word ``w`` is token ``32w + j``, set = allowed), which
  ``worker/sampler.py`` unpacks from ``ForwardBatch.vocab_mask``. Unconstrained rows are all
  ones.

Two things xgrammar 0.2.9 does not do for us: it treats a tokenizer's special tokens
(``<|im_end|>``...) as plain text, so ``GrammarVocab`` bans them (stop tokens excepted); and
JSON strings with ``minLength``/``maxLength`` admit raw control characters, so the schema's
grammar is narrowed (see ``_LOOSE_JSON_CHAR``). JSON compiles with ``any_whitespace=False``
(separators ``", "`` and ``": "``): with free whitespace nothing is ever forced, and
``find_jump_forward_string`` returns "".
"""

from __future__ import annotations

import bisect
import json
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Sequence

import torch
import xgrammar as xgr

KINDS = ("json_schema", "regex", "ebnf")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what OpenAI's response_format json_object means
# Output tokens re-tokenized together with a forced string. Byte-level BPE merges rarely reach
# more than a couple of tokens back; a wider window only costs a longer encode.
JUMP_WINDOW = 4
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: .*? is false: )?")
# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as this class,
# which lets raw control characters (U+0000-U+001F) through; JSON forbids them unescaped.
_LOOSE_JSON_CHAR = r'[^\"\\\r\n]'
_STRICT_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'


class GrammarError(ValueError):
    """An invalid or uncompilable grammar. The message starts with the field name (the kind),
    like the HTTP layer's other 400s: ``"regex: Regex parsing error at position 4: ..."``."""

    def __init__(self, kind: str, problem: str):
        super().__init__(f"{kind}: {problem}")
        self.kind = kind
        self.problem = problem


def _problem(exc: BaseException) -> str:
    """xgrammar's C++ errors carry a timestamp and a source location; keep the problem."""
    return _XGR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__


def _normalize(kind: str, text) -> str:
    """Check ``kind`` and return the grammar text the cache is keyed by."""
    if kind not in KINDS:
        raise GrammarError("constraint", f"unknown kind {kind!r}; expected one of {KINDS}")
    if kind == "json_schema" and isinstance(text, (dict, bool)):
        text = json.dumps(text, sort_keys=True)  # a schema object from a client library
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(kind, "must be a non-empty string")
    return text


def _grammar(kind: str, text: str) -> xgr.Grammar:
    """Parse without the tokenizer; raises xgrammar's error for a bad grammar."""
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    ebnf = str(grammar)
    if _LOOSE_JSON_CHAR in ebnf:  # the printed EBNF parses back to the same grammar
        grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR))
    return grammar


def validate_grammar(kind: str, text) -> None:
    """Raise ``GrammarError`` naming the problem if ``text`` is not a valid ``kind`` grammar.

    Parsing only, no tokenizer needed. A grammar that passes could in rare cases still fail
    to compile; that request then finishes with an error from the scheduler."""
    text = _normalize(kind, text)
    try:
        _grammar(kind, text)
    except Exception as exc:  # xgrammar raises RuntimeError and its own subclasses
        raise GrammarError(kind, _problem(exc)) from None


# ---------------------------------------------------------------------- compilation
class GrammarFuture:
    """One request's view of a (possibly shared) compilation, with its own deadline."""

    def __init__(self, kind: str, future: Future, timeout_s: float):
        self.kind = kind
        self._future = future
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def done(self) -> bool:
        """True once ``result()`` returns or raises without waiting (compiled, failed, or past
        the deadline). Never blocks."""
        return self._future.done() or time.monotonic() >= self._deadline

    def result(self, wait: bool = False) -> xgr.CompiledGrammar:
        """The compiled grammar. Raises ``GrammarError`` if compilation failed or timed out, and
        ``RuntimeError`` if not ``done()`` (unless ``wait``: then block up to the deadline)."""
        if not self._future.done() and wait:
            try:
                self._future.result(timeout=max(self._deadline - time.monotonic(), 0))
            except (TimeoutError, GrammarError):
                pass
        if not self._future.done():
            if time.monotonic() < self._deadline:
                raise RuntimeError("grammar compilation is not done; poll done() first")
            raise GrammarError(self.kind, f"compilation timed out after {self._timeout_s:g} s")
        return self._future.result()


class GrammarVocab:
    """The tokenizer facts the matchers need beyond xgrammar's: the model's vocab size, which
    tokens are banned (special, non-stop), and each token's bytes (for merge checks)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, vocab_size: int,
                 special_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(tokenizer_info.stop_token_ids)
        self.banned_ids = frozenset(t for t in special_ids
                                    if 0 <= t < vocab_size and t not in self.stop_ids)
        words: dict[int, int] = {}
        for t in self.banned_ids:
            words[t >> 5] = words.get(t >> 5, 0) | (1 << (t & 31))
        self._ban_words = torch.tensor(sorted(words), dtype=torch.long)
        keep = [~words[w] & 0xFFFFFFFF for w in sorted(words)]  # as signed int32 below
        self._ban_keep = torch.tensor([k - (1 << 32) if k >> 31 else k for k in keep],
                                      dtype=torch.int32)
        self.token_bytes: list[bytes] = list(tokenizer_info.decoded_vocab)
        ordinary = sorted((b, t) for t, b in enumerate(self.token_bytes)
                          if b and t not in self.banned_ids and t not in self.stop_ids)
        self._sorted_bytes = [b for b, _ in ordinary]
        self._sorted_ids = [t for _, t in ordinary]
        self._extensions: dict[int, torch.Tensor] = {}

    def clear_banned(self, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Clear the banned tokens' bits in ``bitmask[rows]`` (in place)."""
        if len(self._ban_words) and len(rows):
            index = torch.tensor(list(rows), dtype=torch.long).unsqueeze(1)
            bitmask[index, self._ban_words] &= self._ban_keep

    def extensions(self, token_id: int) -> torch.Tensor:
        """Ordinary tokens whose bytes strictly start with ``token_id``'s bytes (cached)."""
        ext = self._extensions.get(token_id)
        if ext is None:
            prefix, ids = self.token_bytes[token_id], []
            i = bisect.bisect_right(self._sorted_bytes, prefix)
            while prefix and i < len(self._sorted_bytes) \
                    and self._sorted_bytes[i].startswith(prefix):
                ids.append(self._sorted_ids[i])
                i += 1
            ext = self._extensions[token_id] = torch.tensor(ids, dtype=torch.long)
        return ext


class GrammarBackend:
    """Compiles grammars for one tokenizer on a thread pool, caching them by (kind, text)."""

    def __init__(self, tokenizer, vocab_size: int, *, num_threads: int = 2,
                 compile_timeout_s: float = 30.0, stop_token_ids: Sequence[int] | None = None,
                 max_cache_entries: int = 1024):
        """``tokenizer`` is a Hugging Face tokenizer; ``vocab_size`` the model's (the logits'
        width, which may exceed the tokenizer's). ``stop_token_ids`` default to its EOS."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self.tokenizer_info = info
        self.vocab = GrammarVocab(info, vocab_size, getattr(tokenizer, "all_special_ids", ()))
        # xgrammar's own cache is off: ours below also shares compilations in flight.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self.compile_timeout_s = compile_timeout_s
        self.max_cache_entries = max_cache_entries
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0  # compilations started (cache misses)

    def submit(self, kind: str, text) -> GrammarFuture:
        """Start compiling (or reuse the cached or in-flight compilation of) ``(kind, text)``.
        Raises ``GrammarError`` at once only for an unknown kind or an empty text; other errors
        come from ``result()``. Mutates the cache."""
        text = _normalize(kind, text)
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, kind, text)
                self._cache[key] = future
                self.num_compiles += 1
                self._evict()
            else:
                self._cache.move_to_end(key)
        return GrammarFuture(kind, future, self.compile_timeout_s)

    def compile(self, kind: str, text) -> xgr.CompiledGrammar:
        """Blocking ``submit(...).result(wait=True)``: for tests, benchmarks and warm-up."""
        return self.submit(kind, text).result(wait=True)

    def new_state(self, compiled: xgr.CompiledGrammar,
                  output_ids: Sequence[int] = ()) -> "GrammarState":
        """A matcher for one request, advanced over ``output_ids`` (see ``from_tokens``)."""
        return GrammarState.from_tokens(compiled, self.vocab, output_ids)

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(_grammar(kind, text))
        except Exception as exc:
            raise GrammarError(kind, _problem(exc)) from None

    def _evict(self) -> None:
        """Drop the least recently used finished entries beyond the limit (lock held)."""
        excess = len(self._cache) - self.max_cache_entries
        for key in [k for k, f in self._cache.items() if f.done()][:max(excess, 0)]:
            del self._cache[key]

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        """Stop the pool; compilations in flight finish, queued ones are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- per request
class Jump(NamedTuple):
    """A jump-forward: drop the last ``retract`` output tokens, then append ``tokens``."""

    tokens: list[int]
    retract: int


class GrammarState:
    """One request's grammar matcher over its output tokens (the prompt is not matched)."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab: GrammarVocab):
        self.compiled = compiled
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_tokens = 0  # output tokens the matcher has accepted

    @classmethod
    def from_tokens(cls, compiled: xgr.CompiledGrammar, vocab: GrammarVocab,
                    output_ids: Sequence[int]) -> "GrammarState":
        """A matcher that has accepted ``output_ids``: how a retracted request gets its state
        back. Raises ``ValueError`` naming the first token the grammar rejects."""
        state = cls(compiled, vocab)
        for i, token in enumerate(output_ids):
            if not state.accept(token):
                raise ValueError(f"output_ids: token {token} at position {i} is rejected by the "
                                 "grammar")
        return state

    def fork(self) -> "GrammarState":
        """An independent copy sharing the compiled grammar (parallel samples, n > 1)."""
        other = GrammarState.__new__(GrammarState)
        other.compiled, other.vocab = self.compiled, self.vocab
        other.matcher, other.num_tokens = self.matcher.fork(), self.num_tokens
        return other

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32). Matcher unchanged."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.vocab.clear_banned(bitmask, [row])

    def accept(self, token_id: int) -> bool:
        """Advance over one sampled token; False (state unchanged) if the grammar rejects it."""
        token_id = int(token_id)
        ok = token_id not in self.vocab.banned_ids and self.matcher.accept_token(token_id)
        self.num_tokens += ok
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"rollback: n must be in [0, {self.num_tokens}], got {n}")
        if n:
            self.matcher.rollback(n)
            self.num_tokens -= n

    def is_terminated(self) -> bool:
        """True once a stop token (EOS) was accepted: the request is done."""
        return self.matcher.is_terminated()

    def only_stop_allowed(self) -> bool:
        """True when the grammar is complete and only a stop token may follow, so the request
        could finish without another forward pass. Costs one mask fill."""
        if not self.matcher.is_completed() or self.matcher.is_terminated():
            return False
        mask = allocate_vocab_mask(1, self.vocab.vocab_size)
        self.fill_mask(mask, 0)
        allowed = _bits(mask[0], torch.arange(self.vocab.vocab_size))
        stops = torch.tensor(sorted(self.vocab.stop_ids), dtype=torch.long)
        return int(allowed.sum()) == int(allowed[stops].sum()) > 0

    # ------------------------------------------------------------------ jump-forward
    def jump_forward(self, tokenizer, output_ids: Sequence[int],
                     window: int = JUMP_WINDOW) -> Jump | None:
        """If the grammar forces a continuation, compute a jump-forward and advance the matcher
        over it; ``output_ids`` (what the matcher accepted) is not changed: apply the ``Jump``.

        Start boundary: the forced string is appended to the decoded text of the last
        ``window`` output tokens and the whole is re-encoded, so the tokens are the tokenizer's
        own (``a`` ``b`` + forced ``c`` may encode as ``a`` ``bc``); tokens after the longest
        common prefix with the old tail are retracted. End boundary: if the grammar allows a
        longer token that starts with the last new token's text, that token is held back (the
        model picks the merged token itself) and the shortened string is encoded again.
        Returns None, matcher unchanged, when nothing is forced or it would not be accepted.
        """
        if len(output_ids) != self.num_tokens:
            raise ValueError(f"output_ids: the matcher has accepted {self.num_tokens} tokens, "
                             f"got {len(output_ids)}")
        if self.matcher.is_terminated():
            return None
        forced = self.matcher.find_jump_forward_string()
        for k in (min(window, len(output_ids)), 0):  # 0: no re-tokenization, the fallback
            tail = list(output_ids[len(output_ids) - k:]) if k else []
            tail_text = _decode(tokenizer, tail)
            if forced and "\ufffd" not in tail_text:  # not inside a split UTF-8 character
                jump = self._retokenize(tokenizer, tail, tail_text, forced)
                if jump is not None:
                    return jump
        return None

    def _retokenize(self, tokenizer, tail: list[int], tail_text: str,
                    forced: str) -> Jump | None:
        while forced:
            text = tail_text + forced
            new = tokenizer.encode(text, add_special_tokens=False)
            if _decode(tokenizer, new) != text:  # a normalizer changed the text
                return None
            keep = _common_prefix(tail, new)
            retracted, body, last = tail[keep:], new[keep:-1], new[-1]
            if not self._swap(len(retracted), body):
                self._swap(0, retracted)
                return None
            if not self._may_merge(last):
                if self.accept(last):
                    return Jump(body + [last], len(retracted))
                self._swap(len(body), retracted)
                return None
            self._swap(len(body), retracted)  # hold ``last`` back: drop its bytes and retry
            cut = len(self.vocab.token_bytes[last])
            raw = forced.encode()
            if cut >= len(raw):
                return None
            try:
                forced = raw[:-cut].decode()
            except UnicodeDecodeError:
                return None
        return None

    def _swap(self, retract: int, tokens: Sequence[int]) -> bool:
        """Roll back ``retract`` tokens, then accept ``tokens``; if one is rejected, undo the
        accepted ones (not the rollback) and return False."""
        self.rollback(retract)
        for i, token in enumerate(tokens):
            if not self.accept(token):
                self.rollback(i)
                return False
        return True

    def _may_merge(self, token_id: int) -> bool:
        """Does the grammar allow, in place of ``token_id``, a longer token starting with it?"""
        ext = self.vocab.extensions(token_id)
        if not len(ext):
            return False
        mask = allocate_vocab_mask(1, self.vocab.vocab_size)
        self.fill_mask(mask, 0)
        return bool(_bits(mask[0], ext).any())


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _bits(row: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The allowed bit of each token in ``ids`` from one bitmask row: [N] int32 of 0/1."""
    return (row[ids >> 5] >> (ids & 31).to(torch.int32)) & 1


# ---------------------------------------------------------------------- batch masks
def allocate_vocab_mask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask ``[batch_size, ceil(vocab_size / 32)]`` with every token allowed
    (the rows of unconstrained requests stay like this)."""
    return torch.full((batch_size, math.ceil(vocab_size / 32)), -1, dtype=torch.int32)


class MaskFiller:
    """Builds a batch's ``ForwardBatch.vocab_mask`` from its requests' matchers; with
    ``num_threads > 1`` the rows are filled on xgrammar's thread pool."""

    def __init__(self, vocab: GrammarVocab, num_threads: int = 1):
        self.vocab = vocab
        self._batch = xgr.BatchGrammarMatcher(max_threads=num_threads) if num_threads > 1 else None

    def __call__(self, states: Sequence[GrammarState | None]) -> torch.Tensor | None:
        """The bitmask for a batch whose row ``i`` has ``states[i]`` (None: unconstrained), or
        None when no row is constrained. Matchers unchanged."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        mask = allocate_vocab_mask(len(states), self.vocab.vocab_size)
        if self._batch is None or len(rows) == 1:
            for i in rows:
                states[i].matcher.fill_next_token_bitmask(mask, i)
        else:
            self._batch.batch_fill_next_token_bitmask([states[i].matcher for i in rows], mask,
                                                      rows)
        self.vocab.clear_banned(mask, rows)
        return mask
