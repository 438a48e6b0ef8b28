"""Incremental detokenization: pieces never split a character, their concatenation equals a
full decode, and stop strings are cut off without ever leaking into a piece."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from radixray.cluster.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld 日本語のテキスト ✓✓ def foo(): return 42",
    "emoji 🚀🔥 mixed with ascii and ümlauts, Ωμέγα and ℝ",
    "plain ascii text with spaces   and\nnewlines\tand tabs",
]


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ids in random-sized groups; return every piece (the last from finish())."""
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        pieces.append(detok.add(ids[i:i + k]))
        i += k
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_concatenate_to_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    # the non-ascii texts do split characters across tokens
    assert text.isascii() or any("\ufffd" in tok.decode([t]) for t in ids)
    for seed in range(5):
        detok = IncrementalDetokenizer(tok)
        pieces = stream(detok, ids, random.Random(seed))
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
        assert detok.text == text


def test_random_ids_concatenate_to_full_decode(tok):
    """Arbitrary id sequences (broken UTF-8 included, special tokens included) still give the
    full decode once finished; before finishing no piece ends in a partial character."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            pieces = stream(detok, ids, rng)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            assert all(not p.endswith("\ufffd") for p in pieces[:-1])


@pytest.mark.parametrize("text,stop,expected,matched", [
    ("def foo(): return 42\nclass Bar:", ["\nclass"], "def foo(): return 42", "\nclass"),
    ("héllo wörld 日本語のテキスト", ["日本"], "héllo wörld ", "日本"),
    ("aaa abd abc tail", ["abc"], "aaa abd ", "abc"),  # "ab" held, then released at "abd"
    ("one two three", ["zzz", "three", "two"], "one ", "two"),  # the earliest one wins
    ("no stop here at all", ["STOP"], "no stop here at all", None),
])
def test_stop_strings_are_cut_and_never_leak(tok, text, stop, expected, matched):
    ids = tok.encode(text, add_special_tokens=False)
    for seed in range(5):
        detok = IncrementalDetokenizer(tok, stop=stop)
        pieces = stream(detok, ids, random.Random(seed))
        assert "".join(pieces) == expected
        sent = ""
        for p in pieces:  # every prefix sent so far is a prefix of the final text
            sent += p
            assert expected.startswith(sent)
        assert detok.matched_stop == matched


@pytest.mark.parametrize("text,stop,stop_regex,expected,matched", [
    ("def foo(): return 42\nclass Bar:", [], [r"\d+"], "def foo(): return ", r"\d+"),
    # "12", "12." and "12.5" may still become a match: held back, never sent and taken back
    ("price: 12.5 or 12.50 EUR", [], [r"\d+\.\d\d"], "price: 12.5 or ", r"\d+\.\d\d"),
    ("one two three", ["three"], [r"t\w+o"], "one ", r"t\w+o"),  # the earliest stop wins
    ("no digits here", [], [r"\d"], "no digits here", None),
])
def test_stop_regexes_are_cut_and_never_leak(tok, text, stop, stop_regex, expected, matched):
    ids = tok.encode(text, add_special_tokens=False)
    for seed in range(5):
        detok = IncrementalDetokenizer(tok, stop=stop, stop_regex=stop_regex)
        pieces = stream(detok, ids, random.Random(seed))
        assert "".join(pieces) == expected
        assert all(expected.startswith("".join(pieces[:i])) for i in range(len(pieces)))
        assert detok.matched_stop == matched
    kept = IncrementalDetokenizer(tok, stop_regex=stop_regex, no_stop_trim=True)
    if matched is not None:  # no_stop_trim: the text ends with the match
        assert "".join(stream(kept, ids, random.Random(0))).startswith(expected)
        assert kept.matched_stop == matched and kept.text != expected


def test_stop_string_kept_with_no_stop_trim_and_later_ids_ignored(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["gamma"], no_stop_trim=True)
    text = "".join(detok.add([t]) for t in ids) + detok.finish()
    assert text == "alpha beta gamma"
    assert detok.matched_stop == "gamma"
    assert detok.add(tok.encode(" more", add_special_tokens=False)) == ""


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    skipped = IncrementalDetokenizer(tok)
    assert skipped.add(ids) + skipped.finish() == "hi"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert kept.add(ids) + kept.finish() == "<|im_start|>hi<|im_end|>"


def _metaspace_tokenizer():
    """A SentencePiece-style (Llama 2, Mistral) tokenizer: its decoder drops the leading space
    of the first word it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁ok": 4, "▁": 5}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def test_an_answer_keeps_its_leading_space_under_a_sentencepiece_tokenizer():
    """Decoded alone, the answer " is ok" after "The capital" read "is ok": echo and SGLang
    programs joined words, and a stop string " is" at the start never matched."""
    from radixray.scheduler.request import FinishReason, Req
    from radixray.scheduler.stop import StopChecker
    from radixray.worker.sampling_params import SamplingParams

    tok, prompt = _metaspace_tokenizer(), [1, 2]
    assert tok.decode([3, 4]) == "is ok"  # the tokenizer's own behaviour
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert detok.add([3]) + detok.add([4]) + detok.finish() == " is ok"
    stopped = IncrementalDetokenizer(tok, stop=[" is"], prompt_ids=prompt)
    stopped.add([3, 4])
    assert stopped.matched_stop == " is" and stopped.text == ""
    req = Req("r", prompt, SamplingParams(stop=[" is"], max_new_tokens=8))
    req.output_ids = [3]
    assert StopChecker(decode=tok.decode).check(req) == FinishReason.stop(" is")
    req = Req("r", prompt, SamplingParams(stop_regex=[r"^\sis"], max_new_tokens=8))
    req.output_ids = [3]  # the regex check reads the same text
    assert StopChecker(decode=tok.decode).check(req) == FinishReason.stop(r"^\sis")


def test_the_stop_check_matches_no_half_decoded_character(tok):
    """A window of tokens that starts or ends inside a character decodes it as U+FFFD: a stop
    string holding U+FFFD matched there, in text the output never had."""
    from radixray.scheduler.request import Req
    from radixray.scheduler.stop import StopChecker
    from radixray.worker.sampling_params import SamplingParams

    ids = tok.encode("😀😀😀 ok", add_special_tokens=False)
    checker = StopChecker(decode=tok.decode)
    for stop in ("\ufffd", "\ufffd😀"):
        req = Req("r", [5], SamplingParams(stop=[stop], max_new_tokens=64))
        for i in range(len(ids)):
            req.output_ids = ids[: i + 1]
            assert checker.check(req) is None, (stop, i)


def test_a_prompt_whose_text_changes_once_the_output_follows_is_decoded_without_it():
    """A tokenizer that cleans up spaces (" 's" -> "'s") changes the prompt's text once the
    output follows: cutting the prompt's text off by its length cut the answer wrong."""
    from radixray.scheduler.stop import decode_after, decode_context

    class CleaningTokenizer:
        pieces = {1: "a", 2: " '", 3: "s", 4: " ok"}

        def decode(self, ids, **_):
            return "".join(self.pieces[i] for i in ids).replace(" 's", "'s")

    tok = CleaningTokenizer()
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 2])
    assert detok.add([3]) + detok.add([4]) + detok.finish() == "s ok"
    assert decode_after(tok.decode, decode_context(tok.decode, [1, 2]), [3, 4]) == "s ok"
