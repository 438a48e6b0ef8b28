"""stop_regex is searched incrementally: each token decodes and searches only its new text (from
where a match may still start), yet the check stops at the same token, on the same pattern, as
a search of the whole decoded output from its start after every token."""

from __future__ import annotations

import functools
import random

import pytest
import regex
from transformers import AutoTokenizer

from radixray.scheduler import stop
from radixray.scheduler.request import Req
from radixray.scheduler.stop import (REPLACEMENT_CHAR, STOP_REGEX_BUDGET_S, StopChecker,
                                     decode_after, decode_context)
from radixray.worker.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def reference_stop(decode, ids, patterns, skip=True):
    """The old unbounded check: after each token, decode the whole output (after the prompt's
    last tokens, less a character cut at the end) and search every pattern from 0."""
    decode = functools.partial(decode, skip_special_tokens=skip,
                               spaces_between_special_tokens=True)
    for i in range(len(ids)):
        text = decode_after(decode, decode_context(decode, PROMPT), ids[:i + 1])
        text = text.rstrip(REPLACEMENT_CHAR)
        for p in patterns:
            if regex.search(p, text):
                return i, p
    return None


def checked_stop(checker, req, ids):
    """Feed ``ids`` to ``req`` one at a time; (index, pattern) of the stop, or None."""
    for t in ids:
        req.output_ids.append(t)
        reason = checker.check(req)
        if reason is not None:
            assert reason.type == "stop", reason
            assert checker.check(req) == reason  # asked again: the same answer
            return len(req.output_ids) - 1, reason.matched
    return None


def new_req(patterns, skip=True):
    return Req("r", list(PROMPT), SamplingParams(max_new_tokens=1 << 20, stop_regex=patterns,
                                                  skip_special_tokens=skip))


def test_a_pattern_that_never_matches_costs_little_over_a_long_output(tok):
    """An unbounded pattern searched the whole output after every token: a request spent its
    1 s of search time in ~30k tokens and ended with a 400, though nothing matched."""
    source = open(stop.__file__).read()
    ids = [t for t in tok.encode(source * 40) if t not in tok.all_special_ids][:40_000]
    assert len(ids) == 40_000
    checker = StopChecker(decode=tok.decode)
    for pattern in [r"zzq\d+x", r"\n\n\n\n\n+", r"(?s)<answer>.*</answer>"]:
        req = new_req([pattern])
        for t in ids:
            req.output_ids.append(t)
            assert checker.check(req) is None
        spent = STOP_REGEX_BUDGET_S - checker._scans[req].budget.left
        # ~0.15 s here (each search's fixed cost); the whole-output search spent 1 s by 30k
        assert spent < 0.5 * STOP_REGEX_BUDGET_S, (pattern, spent)
        # the text kept for the search stays bounded too
        assert len(checker._scans[req].text) < 4 * stop.STOP_REGEX_LOOKBEHIND_CHARS


PIECES = ["a", "b", "x", "1", "2", "42", " ", "\n", "\n\n", "def", " def", "<a>", "</a>",
          "→", "é", "中", "中文", "£", ",", ".", "ab", "zz", "\t"]
PATTERNS = [
    r"ab\d",  # bounded
    r"\d+x",  # unbounded
    r"\n\n\n+",
    r"b.*2x",  # unbounded, partial matches that run long
    r"(?s)<a>.*?</a>",  # across lines
    r"(?<=\d)\s*→",  # lookbehind
    r"(?<![a-z ])def",
    r"\bdef\b",
    r"x$",  # anchored at the (current) end
    r"^\s*a",  # the output's start only
    r"(?m)^def",
    r"zz|é{2}|中文,",  # alternation, multi-byte characters
    r"中.{0,3}→",
    r"£\d",
    r"\W\W\W",  # a character cut at the end must not match as U+FFFD
    r"(?r)1a2",  # searched backwards
    r"x(?!1)\d",  # lookahead
    r"def\B",  # zero-width assertions at the end: a partial match reported at the end
    r"a(?!$)",
]


def random_ids(tok, rng, n_pieces):
    """Text made of ``PIECES`` (so patterns do match), encoded, with some random vocabulary
    ids between (byte tokens cut characters; special tokens decode to nothing)."""
    ids = []
    for _ in range(n_pieces):
        if rng.random() < 0.1:
            ids.append(rng.randrange(tok.vocab_size))
        else:
            ids += tok.encode("".join(rng.choices(PIECES, k=rng.randint(1, 4))),
                              add_special_tokens=False)
    return ids


@pytest.mark.parametrize("lookbehind_chars", [1024, 3])  # 3: the kept text is cut often
def test_the_incremental_check_stops_where_a_full_search_does(tok, monkeypatch,
                                                             lookbehind_chars):
    monkeypatch.setattr(stop, "STOP_REGEX_LOOKBEHIND_CHARS", lookbehind_chars)
    rng = random.Random(lookbehind_chars)
    checker = StopChecker(decode=tok.decode)
    stops = 0
    for case in range(300):
        patterns = rng.sample(PATTERNS, rng.choice([1, 1, 2, 3]))
        skip = rng.random() < 0.8
        ids = random_ids(tok, rng, rng.randint(1, 40))
        expected = reference_stop(tok.decode, ids, patterns, skip)
        assert checked_stop(checker, new_req(patterns, skip), ids) == expected, (case, ids,
                                                                                 patterns)
        stops += expected is not None
    assert 100 < stops < 280  # both outcomes are well represented


# A byte-level vocabulary where every character is split: "→" is three tokens, "é" two.
BYTES = [bytes([b]) for b in range(256)]


def byte_decode(ids, **_):
    return b"".join(BYTES[t] for t in ids).decode(errors="replace")


def test_characters_cut_over_tokens_match_as_a_full_search_does():
    rng = random.Random(1)
    checker = StopChecker(decode=byte_decode)
    for case in range(300):
        patterns = rng.sample(PATTERNS, rng.choice([1, 2]))
        text = "".join(rng.choices(PIECES, k=rng.randint(1, 30)))
        ids = list(text.encode())
        if rng.random() < 0.3:  # a stray continuation or lead byte: an invalid sequence
            ids.insert(rng.randrange(len(ids) + 1), rng.choice([0x80, 0xe4, 0xc3]))
        expected = reference_stop(byte_decode, ids, patterns)
        assert checked_stop(checker, new_req(patterns), ids) == expected, (case, text,
                                                                           patterns)


def test_a_shortened_output_is_searched_again(tok):
    """A request whose output ids were cut back (not done today: retraction keeps them) gets
    a fresh search state, not one resuming past its new end."""
    checker = StopChecker(decode=tok.decode)
    req = new_req([r"ab\d+x"])
    first = tok.encode("zz ab12", add_special_tokens=False)
    assert checked_stop(checker, req, first) is None
    del req.output_ids[1:]
    rest = tok.encode(" ab3x", add_special_tokens=False)
    assert checked_stop(checker, req, rest) == (len(rest), r"ab\d+x")

