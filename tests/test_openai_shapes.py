"""The OpenAI API's pure parts, without a server: token bytes and text offsets for logprobs,
roles for the chat template, usage and best_of ranking, and field names in 400s."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from radixray.cluster.chat_prompt import template_role
from radixray.cluster.detokenizer import (REPLACEMENT_CHAR, TokenBytes, byte_level_alphabet,
                                          text_offsets, token_texts)
from radixray.cluster.engine_protocol import GenerateRequest
from radixray.cluster.http_server import validation_error
from radixray.cluster.openai_api import ChatCompletionRequest, client_field_names
from radixray.cluster.openai_responses import OutputOffsets, most_likely, usage
from radixray.cluster.parallel_sampling import expand_copies
from radixray.worker.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

TEXT = "aé 日本 🙂 x"


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def test_token_texts_decode_each_token_once_per_tokenizer(tiny_llama_path):
    """Every streamed chunk's top-k rows decoded their tokens again (45-60 us a token)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    expected = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    calls = []
    decode = tokenizer.decode
    tokenizer.decode = lambda *a, **k: calls.append(a) or decode(*a, **k)
    assert token_texts(tokenizer, ids) == expected
    assert token_texts(tokenizer, ids + ids) == expected + expected
    assert len(calls) == len(set(ids))


def test_the_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["a"] == ord("a") and alphabet["\u0120"] == ord(" ")  # "Ġ" is a space


def test_byte_level_token_bytes_join_into_the_text(tok):
    token_bytes = TokenBytes.of(tok)
    assert TokenBytes.of(tok) is token_bytes and token_bytes.scheme == "byte_level"
    ids = tok.encode(TEXT)
    pieces = [token_bytes(t) for t in ids]
    assert pieces[0] == tok.bos_token.encode()  # an added token: its text
    assert b"".join(pieces[1:]) == TEXT.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # some hold part of a character


class SentencePieceLike:
    """Just what TokenBytes reads of a SentencePiece-style (byte fallback) tokenizer."""

    vocab = {0: "<s>", 1: "<0xC3>", 2: "<0xA9>", 3: "\u2581hello"}
    added_tokens_decoder = {0: SimpleNamespace(content="<s>")}
    backend_tokenizer = SimpleNamespace(to_str=lambda: json.dumps({"decoder": {
        "type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}}))

    def convert_ids_to_tokens(self, token_id):
        return self.vocab[token_id]


def test_sentencepiece_byte_tokens_and_spaces():
    token_bytes = TokenBytes.of(SentencePieceLike())
    assert token_bytes.scheme == "sentencepiece"
    assert [token_bytes(t) for t in range(4)] == [b"<s>", b"\xc3", b"\xa9", b" hello"]


def test_text_offsets_never_drift_on_partial_characters(tok):
    ids = tok.encode(TEXT)
    text = tok.decode(ids, skip_special_tokens=False)
    offsets = text_offsets(tok, ids, 0, skip_special_tokens=False)
    assert offsets == sorted(offsets) and offsets[1] == len(tok.bos_token)
    for token, offset in zip(ids, offsets):
        alone = tok.decode([token], skip_special_tokens=False)
        if REPLACEMENT_CHAR in alone:  # part of a character: at the character
            assert ord(text[offset]) >= 0x80
        else:
            assert text[offset:].startswith(alone)
    assert text_offsets(tok, ids, 5, skip_special_tokens=True)[:2] == [5, 5]  # BOS: no width
    # a lead byte that no continuation follows stays U+FFFD; the next token is after it
    lone = [*tok.encode("we", add_special_tokens=False), tok.convert_tokens_to_ids("Ã"),
            *tok.encode("x", add_special_tokens=False)]
    assert tok.decode(lone) == "we\ufffdx"
    assert text_offsets(tok, lone)[-1] == 3


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
@pytest.mark.parametrize("skip", [True, False])
def test_offsets_taken_chunk_by_chunk_equal_the_whole_outputs(tok, chunk, skip):
    """A stream's offsets (OutputOffsets fed as the tokens arrive) are the whole answer's,
    whether a chunk ends inside a character or not, a lone lead byte at the end included."""
    ids = tok.encode(TEXT * 2) + [tok.convert_tokens_to_ids("Ã")]
    pairs = [(-1.0, t) for t in ids]
    stream = OutputOffsets(tok, 7, skip)
    for end in range(chunk, len(pairs) + chunk, chunk):
        known = list(stream.offsets)
        stream.update(pairs[:end], final=end >= len(pairs))
        assert stream.offsets[:len(known)] == known  # an offset once given never changes
    assert stream.offsets == text_offsets(tok, ids, 7, skip)


@pytest.mark.parametrize("template,role,templated", [
    ("{{ message['role'] }}", "developer", "system"),
    ("{{ message['role'] }}", "function", "tool"),
    ("{{ message['role'] }}", "user", "user"),
    ("{%- if message.role == 'developer' %}D{% endif %}", "developer", "developer"),
    ("{%- if message['role'] in ['system', \"developer\"] %}S{% endif %}", "developer",
     "developer"),
    ("{%- if message.role == 'tool' %}{{ '\"type\": \"function\"' }}{% endif %}", "function",
     "tool"),
    (None, "developer", "developer"),
])
def test_roles_a_template_does_not_name_fall_back(template, role, templated):
    assert template_role(role, template) == templated


def _state(prompt: int, cached: int, logprobs: list[float]):
    return SimpleNamespace(prompt_tokens=prompt, cached_tokens=cached,
                           completion_tokens=len(logprobs),
                           output_token_logprobs=[(lp, 7) for lp in logprobs])


def test_usage_counts_each_prompt_once_and_every_copys_completion():
    states = [_state(10, 9, [-1.0]), _state(10, 9, [-1.0, -1.0]),
              _state(4, 0, [-1.0]), _state(4, 3, [-1.0])]
    assert usage(states, 2) == {"prompt_tokens": 14, "completion_tokens": 5,
                                "total_tokens": 19, "prompt_tokens_details": {"cached_tokens": 9}}


def test_best_of_keeps_the_most_likely_per_prompt_best_first():
    # per token: a (-2 a token) beats c (-3), though a's sum (-4) is lower than c's
    a, b, c = _state(3, 0, [-2.0, -2.0]), _state(3, 2, [-0.5]), _state(3, 2, [-3.0])
    d, e, f = _state(3, 0, [-1.0]), _state(3, 2, [-1.0]), _state(3, 2, [-0.1])
    kept = most_likely([a, b, c, d, e, f], 3, 2)
    assert [id(s) for s in kept] == [id(b), id(a), id(f), id(d)]  # a tie keeps the order
    empty = _state(3, 0, [])  # a sum would rank it first (0)
    assert [id(s) for s in most_likely([empty, c], 2, 2)] == [id(c), id(empty)]


def test_validation_errors_name_fields_as_the_hand_written_checks_do():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]})
    err = validation_error(caught.value)
    assert err.param == "messages[1].role" and err.message.startswith("messages[1].role: ")


def test_seeds_are_64_bit_and_copies_wrap_within_them():
    for seed in (MIN_SEED - 1, MAX_SEED + 1):
        with pytest.raises(ValueError, match="^seed: "):  # every path's check
            SamplingParams(seed=seed).verify()
    copies = expand_copies(GenerateRequest("r", [1, 2], SamplingParams(n=3, seed=MAX_SEED)), 3)
    # the sampler takes seeds modulo 2**64: 2**64 would be 0 there, so it is 0 here
    assert [c.sampling_params.seed for c in copies] == [MAX_SEED, 0, 1]


def test_field_names_follow_what_the_request_wrote():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 3,
        "response_format": {"type": "json_object"}})
    assert client_field_names(chat) == {"max_new_tokens": "max_completion_tokens",
                                        "min_new_tokens": "min_tokens",
                                        "json_schema": "response_format",
                                        "structural_tag": "response_format"}
