"""Constrained decoding (scheduler/grammar.py) driven by a random "model".

The model is random logits (plus a fixed bias toward tokens holding a closing character, so
strings and numbers end within a few dozen tokens), masked by the grammar through
the reference ``unpack_vocab_mask``, then sampled: a plain loop, no scheduler. Whatever it
samples must be valid under the grammar, so these tests check the masks, the matcher updates
and jump-forward, not the model.
"""

import ast
import json
import re

import jsonschema
import pytest
import torch
from grammar_cases import ARITH, CALL, FIXED_KEYS, REGEXES, arith_ok
from grammar_cases import SCHEMAS as SHARED_SCHEMAS

from radixray.scheduler.grammar import JSON_OBJECT_SCHEMA, GrammarError, validate_grammar
from radixray.scheduler.grammar_compile import GrammarBackend
from radixray.scheduler.grammar_state import JUMP_WINDOW, MaskFiller, allocate_vocab_mask
from radixray.worker.vocab_mask import unpack_vocab_mask

VOCAB = 2048
EOS = 1
MAX_STEPS = 400


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def backend(tokenizer):
    be = GrammarBackend(tokenizer, VOCAB, num_threads=2)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def closing_bias(tokenizer):
    bias = torch.zeros(VOCAB)
    for i in range(len(tokenizer)):
        if any(c in tokenizer.decode([i]) for c in '"}]),;'):
            bias[i] = 3.0
    return bias


def decode(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t != EOS], skip_special_tokens=True)


def generate(backend, tokenizer, states, bias, *, jump: bool, seed: int = 0,
             jumps: list | None = None):
    """Run the states to termination; return (outputs, forward passes per request).

    One loop iteration is one forward pass: every unfinished request samples one token
    (unconstrained rows, ``None`` states, stop after 8). With ``jump``, each request first
    takes any forced continuation, as the scheduler would before building the batch; each
    jump is recorded in ``jumps`` as (output before, Jump, output after).
    """
    gen = torch.Generator().manual_seed(seed)
    fill = MaskFiller(backend.vocab, num_threads=2)
    outputs = [[] for _ in states]
    passes = [0] * len(states)
    live = [i for i, s in enumerate(states) if s is not None]
    free = [i for i, s in enumerate(states) if s is None]
    for _ in range(MAX_STEPS):
        rows = live + [i for i in free if len(outputs[i]) < 8]
        if not rows:
            break
        if jump:
            for i in live:
                j = states[i].jump_forward(tokenizer, outputs[i])
                if j is not None:
                    old = outputs[i]
                    outputs[i] = old[:len(old) - j.retract] + j.tokens
                    if jumps is not None:
                        jumps.append((old, j, list(outputs[i])))
        mask = fill([states[i] for i in rows])  # None once only unconstrained rows are left
        logits = torch.randn(len(rows), VOCAB, generator=gen) + bias
        if mask is not None:
            logits.masked_fill_(~unpack_vocab_mask(mask, VOCAB), float("-inf"))
        sampled = torch.multinomial(logits.softmax(-1), 1, generator=gen).flatten().tolist()
        for i, token in zip(rows, sampled):
            passes[i] += 1
            outputs[i].append(token)
            if states[i] is not None:
                assert states[i].accept(token), f"masked sample {token} rejected"
        live = [i for i in live if not states[i].is_terminated()]
    assert not live, "a constrained request did not terminate"
    return outputs, passes


# ---------------------------------------------------------------------- JSON schema
SCHEMAS = {**SHARED_SCHEMAS, "json_object": json.loads(JSON_OBJECT_SCHEMA)}


@pytest.mark.parametrize("jump", [False, True], ids=["plain", "jump"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_outputs_validate(name, jump, backend, tokenizer, closing_bias):
    schema = SCHEMAS[name]
    compiled = backend.compile("json_schema", json.dumps(schema))
    # a mixed batch: constrained rows and two unconstrained ones
    states = [backend.new_state(compiled) for _ in range(6)] + [None, None]
    outputs, _ = generate(backend, tokenizer, states, closing_bias, jump=jump, seed=len(name))
    for out in outputs[:6]:
        assert out[-1] == EOS  # the grammar terminated by accepting EOS
        value = json.loads(decode(tokenizer, out))
        jsonschema.validate(value, schema)
    assert all(len(out) == 8 for out in outputs[6:])


def test_bounded_strings_exclude_control_characters(backend, tokenizer):
    """xgrammar 0.2.9 lets raw control characters into strings with maxLength; the backend
    narrows that (JSON forbids them unescaped)."""
    state = backend.new_state(backend.compile("json_schema",
                                              '{"type": "string", "maxLength": 5}'))
    assert state.accept(tokenizer.encode('"', add_special_tokens=False)[0])
    mask = MaskFiller(backend.vocab)([state])
    allowed = set(unpack_vocab_mask(mask, VOCAB)[0].nonzero().flatten().tolist())
    control = [i for i in range(5, len(tokenizer))
               if any(ord(c) < 0x20 for c in tokenizer.decode([i]))]
    assert control and not allowed & set(control)
    assert tokenizer.encode("ab", add_special_tokens=False)[0] in allowed


# ---------------------------------------------------------------------- regex and EBNF
@pytest.mark.parametrize("jump", [False, True], ids=["plain", "jump"])
def test_regex_outputs_full_match(jump, backend, tokenizer, closing_bias):
    states = [backend.new_state(backend.compile("regex", r)) for r in REGEXES for _ in range(3)]
    outputs, _ = generate(backend, tokenizer, states, closing_bias, jump=jump, seed=1)
    for k, out in enumerate(outputs):
        text = decode(tokenizer, out)
        assert re.fullmatch(REGEXES[k // 3], text), (REGEXES[k // 3], text)


@pytest.mark.parametrize("jump", [False, True], ids=["plain", "jump"])
def test_ebnf_outputs_parse(jump, backend, tokenizer, closing_bias):
    arith, call = backend.compile("ebnf", ARITH), backend.compile("ebnf", CALL)
    states = [backend.new_state(arith) for _ in range(4)] + \
             [backend.new_state(call) for _ in range(4)]
    outputs, _ = generate(backend, tokenizer, states, closing_bias, jump=jump, seed=2)
    for out in outputs[:4]:
        text = decode(tokenizer, out)
        assert re.fullmatch(r"[0-9+\-()]+", text) and not re.search(r"(^|[^0-9])0", text), text
        assert arith_ok(ast.parse(text, mode="eval").body), text
    for out in outputs[4:]:
        text = decode(tokenizer, out)
        assert re.fullmatch(r"(f|g|sum)\(((\d|[1-9]\d)(, (\d|[1-9]\d))*)?\)", text), text


# ---------------------------------------------------------------------- jump-forward
def test_jump_forward_saves_passes_and_keeps_tokenizer_boundaries(backend, tokenizer,
                                                                  closing_bias):
    compiled = backend.compile("json_schema", json.dumps(FIXED_KEYS))
    n = 8
    plain, plain_passes = generate(backend, tokenizer,
                                   [backend.new_state(compiled) for _ in range(n)],
                                   closing_bias, jump=False, seed=3)
    jumps = []
    jumped, jump_passes = generate(backend, tokenizer,
                                   [backend.new_state(compiled) for _ in range(n)],
                                   closing_bias, jump=True, seed=3, jumps=jumps)
    for out in plain + jumped:
        jsonschema.validate(json.loads(decode(tokenizer, out)), FIXED_KEYS)
    assert sum(jump_passes) <= 0.6 * sum(plain_passes), (jump_passes, plain_passes)
    # Each jump re-tokenized its boundary: the re-encoded window equals what the tokenizer
    # makes of that text, and the tokens before it are untouched. Where the old window starts
    # or ends inside a UTF-8 character it cannot be re-encoded: the forced text alone is.
    assert len(jumps) >= 4 * n
    for old, j, new in jumps:
        start = max(len(old) - JUMP_WINDOW, 0)
        assert new[:start] == old[:start]
        window = new[start:]
        if "\ufffd" in tokenizer.decode(old[start:]):
            window = j.tokens
            assert j.retract == 0
        assert tokenizer.encode(tokenizer.decode(window), add_special_tokens=False) == window
        assert tokenizer.decode(new).startswith(tokenizer.decode(old))  # text only grows
    assert any(j.retract > 0 for _, j, _ in jumps), "no jump merged into a sampled token"
    # End boundary: a jump never ends on a token the grammar would let a longer token replace
    # (the model picks that one); so some jumps stop short of the forced text.
    held_back = 0
    for _, _, new in jumps:
        before_last = backend.new_state(compiled, new[:-1])
        mask = MaskFiller(backend.vocab)([before_last])
        longer = backend.vocab.extensions(new[-1]).tolist()
        assert not unpack_vocab_mask(mask, VOCAB)[0, longer].any()
        held_back += backend.new_state(compiled, new).matcher.find_jump_forward_string() != ""
    assert held_back > 0


def test_jump_forward_retracts_a_token_that_merges(backend, tokenizer):
    state = backend.new_state(backend.compile("regex", r'[0-9]+": "done"'))
    seven, quote = tokenizer.encode('7"', add_special_tokens=False)
    assert state.accept(seven) and state.accept(quote)
    j = state.jump_forward(tokenizer, [seven, quote])
    # '7' '"' + forced ': "done"' re-encodes as '7' '":' ' "' ...: the quote is retracted
    assert j.retract == 1
    new = [seven] + j.tokens
    assert new == tokenizer.encode('7": "done"', add_special_tokens=False)
    assert state.num_tokens == len(new)
    assert state.jump_forward(tokenizer, new) is None  # nothing more is forced but EOS
    assert state.only_stop_allowed()
    assert state.accept(EOS) and state.is_terminated()


def test_jump_forward_leaves_unforced_state_alone(backend, tokenizer):
    state = backend.new_state(backend.compile("regex", r"[a-z]+"))
    assert state.jump_forward(tokenizer, []) is None
    assert state.num_tokens == 0 and not state.only_stop_allowed()
    with pytest.raises(ValueError, match="output_ids"):
        state.jump_forward(tokenizer, [5])  # not what the matcher accepted


# ---------------------------------------------------------------------- state handling
def test_mask_layout_is_the_samplers(backend, tokenizer):
    """Every token the unpacked mask allows is accepted by the matcher, and a sample of the
    others is rejected: the bitmask and unpack_vocab_mask agree on the bit layout."""
    compiled = backend.compile("regex", r"(ab|cd)[0-9]+")
    state, twin = backend.new_state(compiled), backend.new_state(compiled)
    mask = MaskFiller(backend.vocab, num_threads=2)([None, state, twin])  # one state per row
    allowed = unpack_vocab_mask(mask, VOCAB)
    assert bool(allowed[0].all())
    assert torch.equal(allowed[1], allowed[2])
    ids = allowed[1].nonzero().flatten().tolist()
    assert 0 < len(ids) < VOCAB
    for t in ids:
        assert state.fork().accept(t), tokenizer.decode([t])
    for t in range(0, VOCAB, 7):
        if t not in ids:
            assert not state.fork().accept(t)


def test_special_tokens_are_banned(backend, tokenizer):
    """xgrammar treats <|im_end|> and friends as text; the vocab bans them, EOS excepted."""
    state = backend.new_state(backend.compile("regex", r"[^\n]{0,40}"))
    allowed = unpack_vocab_mask(MaskFiller(backend.vocab)([state]), VOCAB)[0]
    specials = [t for t in tokenizer.all_special_ids if t != EOS]
    assert specials and not allowed[specials].any()
    assert allowed[EOS] and allowed[tokenizer.encode("ab", add_special_tokens=False)[0]]
    assert not any(state.accept(t) for t in specials) and state.num_tokens == 0


def test_recreate_from_tokens_and_rollback(backend, tokenizer, closing_bias):
    compiled = backend.compile("json_schema", json.dumps(SCHEMAS["nested"]))
    outputs, _ = generate(backend, tokenizer, [backend.new_state(compiled)], closing_bias,
                          jump=True, seed=4)
    out = outputs[0]
    # A retracted request keeps its tokens; its new matcher must mask like the old one did.
    live = backend.new_state(compiled, out[:-3])
    again = backend.new_state(compiled, out[:-3])
    m1, m2 = allocate_vocab_mask(2, VOCAB), allocate_vocab_mask(2, VOCAB)
    live.fill_mask(m1, 1)
    again.fill_mask(m2, 1)
    assert torch.equal(m1, m2) and not bool((m1[1] == -1).all())
    live.accept(out[-3])
    live.rollback(1)
    live.fill_mask(m1, 0)
    assert torch.equal(m1[0], m2[1])
    full = backend.new_state(compiled, out)
    assert full.is_terminated() and full.num_tokens == len(out)
    with pytest.raises(ValueError, match="rollback"):
        live.rollback(live.num_tokens + 1)
    bad = tokenizer.encode("}", add_special_tokens=False)
    with pytest.raises(ValueError, match="position 0"):
        backend.new_state(compiled, bad)


# ---------------------------------------------------------------------- errors and the cache
@pytest.mark.parametrize("kind,text,problem", [
    ("json_schema", '{"type": "objec"}', 'Unsupported type "objec"'),
    ("json_schema", "{not json", "Failed to parse JSON"),
    ("json_schema", "[1, 2]", "should be an object"),
    ("regex", "a(b", "parenthesis is not closed"),
    ("regex", "a{3,1}", "Lower bound is larger than upper bound"),
    ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ("ebnf", 'start ::= "a"', 'root rule with name "root" is not found'),
])
def test_invalid_grammars_name_the_problem(kind, text, problem, backend):
    with pytest.raises(GrammarError, match=re.escape(problem)) as info:
        validate_grammar(kind, text)
    assert str(info.value).startswith(f"{kind}: ") and "/project/" not in str(info.value)
    future = backend.submit(kind, text)
    with pytest.raises(GrammarError, match=re.escape(problem)) as info:
        future.result(wait=True)
    assert info.value.kind == kind and isinstance(info.value, ValueError)


def test_bad_kind_and_empty_text():
    with pytest.raises(GrammarError, match="unknown kind"):
        validate_grammar("yaml", "a")
    with pytest.raises(GrammarError, match="^regex: must be a non-empty string"):
        validate_grammar("regex", "")
    validate_grammar("regex", " ")  # one space: a grammar (it was refused as empty)
    with pytest.raises(GrammarError, match="^json_schema: must be a non-empty string"):
        validate_grammar("json_schema", "  ")
    validate_grammar("json_schema", {"type": "object"})  # a schema object is fine too
