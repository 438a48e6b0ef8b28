"""One request's grammar state: the xgrammar matcher over its output tokens, its row of the
batch token bitmask, and jump-forward with boundary re-tokenization.

- ``GrammarVocab``: the tokenizer facts the matchers need beyond xgrammar's. xgrammar 0.2.9
  treats a tokenizer's special tokens (``<|im_end|>``...) as plain text, so they are banned
  here (stop tokens excepted); each token's bytes serve the jump-forward merge check.
- ``GrammarState``: ``fill_mask``, ``accept``, ``rollback``, ``jump_forward``, ``from_tokens``
  (a retracted request re-creates its matcher from its output tokens).
- ``MaskFiller`` / ``allocate_vocab_mask``: the batch bitmask ``[B, ceil(V/32)]`` int32 in
  xgrammar's layout (bit ``j`` of word ``w`` is token ``32w + j``, set = allowed), which
  the sampler applies from ``ForwardBatch.vocab_mask`` (``worker/vocab_mask.py``).
  Unconstrained rows are all ones.

Jump-forward needs grammars compiled with ``any_whitespace=False`` (``grammar.py`` does so for
JSON): with free whitespace nothing is ever forced.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple, Sequence

import torch
import xgrammar as xgr

# Output tokens re-tokenized together with a forced string. Byte-level BPE merges rarely reach
# more than a couple of tokens back; a wider window only costs a longer encode.
JUMP_WINDOW = 4


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
        self.dead_end = False  # no token may follow, yet the grammar is not done (rare)

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
        other.dead_end = self.dead_end
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

    def _allowed(self) -> torch.Tensor:
        """The allowed bit of every token next ([V] int32 of 0/1). Costs one mask fill."""
        mask = allocate_vocab_mask(1, self.vocab.vocab_size)
        self.fill_mask(mask, 0)
        return _bits(mask[0], torch.arange(self.vocab.vocab_size))

    def allows_nothing(self) -> bool:
        """True when no token may follow (and the grammar is not done): an empty language."""
        return not self.matcher.is_terminated() and not bool(self._allowed().any())

    def only_stop_allowed(self) -> bool:
        """True when the grammar is complete and only a stop token may follow, so the request
        could finish without another forward pass."""
        if not self.matcher.is_completed() or self.matcher.is_terminated():
            return False
        allowed = self._allowed()
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
            if any(t in self.vocab.stop_ids or t in self.vocab.banned_ids for t in new):
                # Forced text that spells a special token (``<|eos|>``) is ordinary text the
                # model writes under the mask; as the real token it would end the request
                # mid-grammar. (``split_special_tokens`` would encode it as text, but sets a
                # flag on the tokenizer the HTTP layer shares.)
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
        None when no row is constrained. Matchers unchanged. Each row needs a state of its own:
        xgrammar's thread pool fills rows in parallel, and a matcher is not thread-safe."""
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
