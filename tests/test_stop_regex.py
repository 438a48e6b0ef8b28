"""stop_regex: the scheduler's check sees every match that ends in the newest token (a window
from the longest text the regex can match, the whole output when unbounded), and text is cut
where the regex first matches."""

from __future__ import annotations

import pytest

from radixray.scheduler.request import FinishReason, Req
from radixray.scheduler.stop import (StopChecker, find_stop, regex_holdback,
                                     trim_stop_text)
from radixray.worker.sampling_params import SamplingParams

PIECES = ["ab", "c", "de", "f", "gh", "i", "jk", "l", "1", "23"]


def piece_decode(ids, **_):
    return "".join(PIECES[t] for t in ids)


def first_stop(pattern, ids, **params):
    """Feed ``ids`` one at a time; the index of the token that stopped the request, or None."""
    checker = StopChecker(decode=piece_decode)
    req = Req("r", [0], SamplingParams(max_new_tokens=100, stop_regex=[pattern], **params))
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        reason = checker.check(req)
        if reason is not None:
            assert reason.to_dict() == {"type": "stop", "matched": pattern}
            return i
    return None


@pytest.mark.parametrize("pattern,ids,stops_at", [
    (r"cd", [0, 1, 2, 3], 2),  # "ab" "c" "de": the match spans two tokens
    (r"\d\d", [0, 8, 0, 9], 3),  # "1" then later "23": the first two adjacent digits
    (r"b.*l", [0, 1, 2, 3, 4, 5, 6, 7], 7),  # unbounded: 'b' is 7 tokens back
    (r"fgh?i", [3, 4, 5], 2),
    (r"zz", [0, 1, 2], None),
])
def test_the_check_stops_at_the_token_that_completes_a_match(pattern, ids, stops_at):
    assert first_stop(pattern, ids) == stops_at


def test_min_new_tokens_does_not_delay_a_regex():
    assert first_stop("c", [0, 1, 2, 3], min_new_tokens=4) == 1


def test_text_is_cut_where_the_regex_first_matches():
    text = "x = 12 + 345"
    reason = FinishReason.stop(r"\d+")
    assert trim_stop_text(text, reason, False, [r"\d+"]) == "x = "
    assert trim_stop_text(text, reason, True, [r"\d+"]) == text  # no_stop_trim
    # the same text as a stop string (not a regex) is cut only where it literally appears
    assert trim_stop_text(r"a \d+ b", reason, False) == "a "


def test_find_stop_takes_the_earliest_string_or_regex_and_partial_matches_hold_back():
    assert find_stop("one two three", 0, ["three"], [r"t\w+o"]) == (4, 7, r"t\w+o")
    assert find_stop("one two three", 0, ["two"], [r"th\w+"]) == (4, 7, "two")
    assert find_stop("one two", 5, ["two"], []) is None  # before `start` does not count
    # "12." may still become "12.50": hold it back; "ab" may not become a match of it
    assert regex_holdback("total 12.", 0, [r"\d+\.\d\d"]) == 3
    assert regex_holdback("total ab", 0, [r"\d+\.\d\d"]) == 0


@pytest.mark.parametrize("pattern,error", [("a(b", "not a valid regular expression"),
                                           ("x*", "matches the empty string"),
                                           ("x" * 513, "at most 512 characters")])
def test_bad_patterns_are_rejected_naming_the_field(pattern, error):
    with pytest.raises(ValueError, match=f"^stop_regex: .*{error}"):
        SamplingParams(stop_regex=[pattern]).verify()


def test_a_backtracking_pattern_ends_its_own_request_instead_of_stalling_the_replica():
    """A search that backtracks for ever froze the engine's thread and the HTTP event loop
    (only kill -9 ended it); now it gives up when the request's search time is spent and ends
    its request."""
    import time

    from radixray.scheduler.stop import STOP_REGEX_BUDGET_S, StopRegexTooSlow

    pattern = r"(.|.)+\d{6}"
    started = time.monotonic()
    with pytest.raises(StopRegexTooSlow, match=r"^stop_regex: .* took over"):
        regex_holdback("a" * 40 + "x", 0, [pattern])
    with pytest.raises(StopRegexTooSlow):
        find_stop("a" * 40 + "x", 0, [], [pattern])
    # token i reads 40 "a"s and i "x"s: the output (token 1) is "aaa...ax"
    checker = StopChecker(decode=lambda ids, **_: "".join("a" * 40 + "x" * i for i in ids))
    req = Req("r", [0], SamplingParams(max_new_tokens=100, stop_regex=[pattern]))
    req.output_ids.append(1)
    reason = checker.check(req).to_dict()
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith("stop_regex: ")
    assert time.monotonic() - started < 5 * STOP_REGEX_BUDGET_S


def test_many_quick_patterns_share_one_budget_per_request():
    """Twenty patterns each under any per-search limit slowed the whole replica 5x: the time
    adds up per request, and the request that spends it ends alone."""
    from radixray.scheduler.stop import RegexBudget, StopRegexTooSlow

    budget = RegexBudget(0.05)
    text = "a" * 22 + "x"
    patterns = [r"(a|a)+\d" + str(i) for i in range(40)]  # each backtracks ~2^22 steps: slow
    with pytest.raises(StopRegexTooSlow):
        for _ in range(100):
            find_stop(text, 0, [], patterns, budget)
    assert budget.left <= 0
    with pytest.raises(StopRegexTooSlow):  # spent for good: the next search refuses at once
        budget.search(r"\d", "1", 0)
    assert find_stop("abc 1", 0, [], [r"\d"]) == (4, 5, r"\d")  # a fresh budget per call


# ---------------------------------------------------------------- multi-byte stops
BYTES = [b"x", "→".encode()[:1], "→".encode()[1:2], "→".encode()[2:], b"y", b"\xc3", b"\xa9"]


def byte_decode(ids, **_):
    """A byte-level vocabulary (as BPE's): one character may take several tokens."""
    return b"".join(BYTES[t] for t in ids).decode(errors="replace")


@pytest.mark.parametrize("field,stop,ids,stops_at", [
    ("stop", "→", [0, 1, 2, 3, 4], 3),  # x → (three tokens) y
    ("stop_regex", "→", [0, 1, 2, 3, 4], 3),
    ("stop", "éé", [0, 5, 6, 5, 6, 4], 4),  # x é é y, two tokens each
    ("stop_regex", r"y(é|→)", [0, 4, 1, 2, 3], 4),
])
def test_stops_made_of_multi_byte_characters(field, stop, ids, stops_at):
    """"→" is three tokens here: the window must count the stop's bytes, not characters."""
    checker = StopChecker(decode=byte_decode)
    r = Req("r", [0], SamplingParams(max_new_tokens=100, **{field: [stop]}))
    stopped = None
    for i, t in enumerate(ids):
        r.output_ids.append(t)
        if checker.check(r) is not None:
            stopped = i
            break
    assert stopped == stops_at
    assert checker.check(r) == FinishReason.stop(stop)


def test_min_new_tokens_holds_off_tokens_not_strings():
    """SGLang's rule: min_new_tokens masks EOS and stop_token_ids; stop strings match from
    the first token, so the scheduler agrees with the HTTP detokenizer and the trimmed text."""
    checker = StopChecker(eos_token_ids=[9], decode=piece_decode)
    r = Req("r", [0], SamplingParams(max_new_tokens=100, min_new_tokens=5, stop=["c"],
                                     stop_token_ids=[6]))
    r.output_ids += [0, 1]
    assert checker.check(r) == FinishReason.stop("c")
    r = Req("r", [0], SamplingParams(max_new_tokens=100, min_new_tokens=5, stop_token_ids=[6]))
    r.output_ids += [0, 6]
    assert checker.check(r) is None
    r.output_ids += [0, 0, 6]
    assert checker.check(r) == FinishReason.stop(6)


# ---------------------------------------------------------------- the window's edges
WORDS = [" un", "def", "ined", " x", " one", " two", "中".encode()[:2], "中".encode()[2:], ","]


def word_decode(ids, skip_special_tokens=True, **_):
    text = b"".join(w if isinstance(w, bytes) else w.encode() for w in map(WORDS.__getitem__,
                                                                            ids))
    return text.decode(errors="replace")


def word_stop(pattern, ids):
    checker = StopChecker(decode=word_decode)
    req = Req("r", [0], SamplingParams(max_new_tokens=100, stop_regex=[pattern]))
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        if checker.check(req) is not None:
            return i
    return None


@pytest.mark.parametrize("pattern, ids", [
    # once the window (13 tokens for a 3-character pattern) began at "def", \b matched there
    (r"\bdef", [0, 1, 2] + [3] * 20),
    (r"(?<![a-z])def", [0, 1, 2] + [3] * 20),
    # ^ matched at the window's first token, not only at the output's start
    (r"^ one", [3] * 20 + [4, 5] * 10),
    # a character split over two tokens decoded to U+FFFD, which \W matched at once
    (r"\W", [6, 7, 6, 7]),
])
def test_the_window_start_and_a_split_character_are_no_matches(pattern, ids):
    """The text the client gets has no match: the HTTP detokenizer, which searches all of it,
    did not stop, while the scheduler did (and the text kept no match)."""
    text = word_decode(ids)
    assert find_stop(text, 0, (), [pattern]) is None
    assert word_stop(pattern, ids) is None


def test_a_match_after_a_split_character_still_stops():
    assert word_stop(r"\W", [6, 7, 6, 7, 8, 6, 7]) == 4  # 中中, then the comma


@pytest.mark.parametrize("skip, stops", [(True, True), (False, False)])
def test_stop_strings_read_the_text_the_client_gets(skip, stops):
    """A hidden special token between "d" and "c": the client's text has "dc" and the HTTP
    detokenizer stopped there, while the scheduler decoded with special tokens kept and ran on
    (the offline Engine's answer then differed from HTTP's)."""
    vocab = {0: "d", 1: "<|pad|>", 2: "c"}

    def decode(ids, skip_special_tokens=False, **_):
        return "".join(vocab[t] for t in ids if not (skip_special_tokens and t == 1))

    checker = StopChecker(decode=decode)
    req = Req("r", [0], SamplingParams(max_new_tokens=100, stop=["dc"],
                                       skip_special_tokens=skip))
    req.output_ids += [0, 1, 2]
    assert (checker.check(req) == FinishReason.stop("dc")) is stops
