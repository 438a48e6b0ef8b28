"""Constrained decoding through the real Engine (scheduler, model runner, sampler) on the tiny
random-weight Llama: JSON schema, regex and EBNF outputs are valid, jump-forward on and off,
mixed batches, overlap, retraction, chunked and mixed prefill, the grammar queue, and HTTP.

The random model would wander in strings and numbers for a long time, so constrained requests
sample (seeded) with a logit bias toward tokens holding a closing character and toward EOS
(as test_grammar.py's ``closing_bias``); the grammar still decides what is allowed, so every
output must be valid. Every Engine checks the memory invariant after every step.
"""

import ast
import json
import re
import threading

import httpx
import jsonschema
import pytest
from grammar_cases import ARITH, CALL, FIXED_KEYS, REGEXES, SCHEMAS, arith_ok
from http_helpers import MODEL_NAME, ServerThread, make_engine, wait_idle

from radixray.cluster import Engine

EOS = 1
STOPS = (1, 4)  # the tiny model's eos_token_id list: <|eos|>, <|im_end|>
MAX_NEW = 320
PROMPTS = ["Reply with JSON:", "Fill in the form please", "Data:", "Give me an answer now."]

BOUNDED_NESTED = {  # every string and number bounded: outputs stay short
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "profile": {"type": "object",
                    "properties": {"tags": {"type": "array", "maxItems": 2,
                                            "items": {"type": "string", "maxLength": 6}},
                                   "role": {"enum": ["admin", "user"]}},
                    "required": ["tags", "role"]},
    },
    "required": ["id", "profile"],
}
LONG_KEYS = {"type": "object",
             "properties": {f"field_number_{w}": {"type": "boolean"}
                            for w in ("one", "two", "three", "four")},
             "required": [f"field_number_{w}" for w in ("one", "two", "three", "four")]}



@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def closing_bias(tokenizer) -> dict[int, float]:
    bias = {i: 3.0 for i in range(len(tokenizer))
            if any(c in tokenizer.decode([i]) for c in '"}]),;')}
    bias[EOS] = 3.0
    return bias


def engine(path, **args) -> Engine:
    return Engine(path, **{"max_total_tokens": 4096, "debug_invariants": True, **args})


@pytest.fixture(scope="module")
def jump_engine(tiny_llama_path):
    with engine(tiny_llama_path) as e:
        yield e


@pytest.fixture(scope="module")
def plain_engine(tiny_llama_path):
    with engine(tiny_llama_path, disable_jump_forward=True) as e:
        yield e


def constrained(kind: str, text, bias, seed: int, **extra) -> dict:
    text = json.dumps(text) if kind == "json_schema" else text
    return {kind: text, "max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": seed,
            "logit_bias": bias, **extra}


def run(e: Engine, params: list[dict], prompts=None) -> list[dict]:
    prompts = prompts or [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = e.generate(prompt=prompts, sampling_params=params)
    e.scheduler.check_invariant()
    assert not e.scheduler.live and not e.scheduler.grammars.queue
    return outs


def assert_stopped(out: dict) -> str:
    """The request finished because its grammar did (a stop token accepted); its text."""
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in STOPS, out
    assert out["output_ids"][-1] == reason["matched"] and len(out["output_ids"]) < MAX_NEW
    return out["text"]


def check_json(outs: list[dict], schemas: list[dict]) -> None:
    for out, schema in zip(outs, schemas, strict=True):
        jsonschema.validate(json.loads(assert_stopped(out)), schema)


@pytest.fixture(params=["jump", "plain"])
def any_engine(request, jump_engine, plain_engine):
    return jump_engine if request.param == "jump" else plain_engine


# ---------------------------------------------------------------------- validity
def test_json_schema_outputs_validate(any_engine, closing_bias):
    schemas = [s for s in SCHEMAS.values() for _ in range(3)]
    params = [constrained("json_schema", s, closing_bias, seed=i) for i, s in enumerate(schemas)]
    check_json(run(any_engine, params), schemas)


def test_regex_outputs_full_match(any_engine, closing_bias):
    regexes = [r for r in REGEXES for _ in range(3)]
    outs = run(any_engine, [constrained("regex", r, closing_bias, seed=i)
                            for i, r in enumerate(regexes)])
    for out, regex in zip(outs, regexes):
        assert re.fullmatch(regex, assert_stopped(out)), (regex, out["text"])


def test_ebnf_outputs_parse(any_engine, closing_bias):
    grammars = [ARITH] * 4 + [CALL] * 4
    outs = run(any_engine, [constrained("ebnf", g, closing_bias, seed=i)
                            for i, g in enumerate(grammars)])
    for out in outs[:4]:
        text = assert_stopped(out)
        assert re.fullmatch(r"[0-9+\-()]+", text) and arith_ok(ast.parse(text, "e", "eval").body)
    for out in outs[4:]:
        assert re.fullmatch(r"(f|g|sum)\(((\d|[1-9]\d)(, (\d|[1-9]\d))*)?\)", assert_stopped(out))


# ---------------------------------------------------------------------- jump-forward
def _passes(e: Engine) -> int:
    s = e.scheduler.stats
    return s.num_prefill_batches + s.num_decode_batches


def test_jump_forward_saves_forward_passes(jump_engine, plain_engine, closing_bias):
    params = [constrained("json_schema", FIXED_KEYS, closing_bias, seed=i) for i in range(6)]
    counts, jumps = {}, {}
    for name, e in (("jump", jump_engine), ("plain", plain_engine)):
        before, jumped = _passes(e), e.scheduler.grammars.num_jumps
        check_json(run(e, params), [FIXED_KEYS] * 6)
        counts[name] = _passes(e) - before
        jumps[name] = e.scheduler.grammars.num_jumps - jumped
    assert jumps["plain"] == 0 and jumps["jump"] >= 4 * 6
    assert counts["jump"] <= 0.5 * counts["plain"], counts


def test_jump_tokens_are_the_tokenizers(jump_engine, tokenizer, closing_bias):
    """A jump re-tokenizes its boundary: every forced piece of the output is what the
    tokenizer makes of its text, so the whole output of a fully forced grammar is too."""
    out = run(jump_engine, [constrained("regex", r'\{"status": "(ok|failed)", "code": 200\}',
                                        closing_bias, seed=1)])[0]
    text = assert_stopped(out)
    assert out["output_ids"][:-1] == tokenizer.encode(text, add_special_tokens=False)


def test_forced_grammar_needs_only_the_prefill(jump_engine, tokenizer):
    """A regex with one possible string is appended whole when its grammar is ready, with
    EOS: the request finishes without any forward pass, and its text comes in one output."""
    before = _passes(jump_engine)
    out = run(jump_engine, [{"regex": "hello world", "max_new_tokens": 32}])[0]
    assert assert_stopped(out) == "hello world" and _passes(jump_engine) == before
    out = run(jump_engine, [{"regex": "hello world", "max_new_tokens": 2}])[0]
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # no room: decoded normally


def test_cached_tokens_count_only_the_prompt(jump_engine, closing_bias):
    """A jump-forward opening is output that a repeat of the request finds in the tree; the
    usage figure counts prompt tokens only (it was prompt_len + the opening: above prompt_len)."""
    params = [constrained("json_schema", FIXED_KEYS, closing_bias, seed=3)]
    first = run(jump_engine, params)[0]["meta_info"]
    again = run(jump_engine, params)[0]["meta_info"]
    assert again["prompt_tokens"] == first["prompt_tokens"]
    # all of the prompt may hit: the opening after it is in the tree too
    assert again["prompt_tokens"] - 1 <= again["cached_tokens"] <= again["prompt_tokens"]


# ---------------------------------------------------------------------- batches and memory
def test_mixed_batch_free_requests_unchanged(jump_engine, closing_bias):
    free = [{"max_new_tokens": 12, "temperature": 0.0} for _ in range(3)]
    alone = run(jump_engine, free, PROMPTS[:3])
    cons = [constrained("json_schema", SCHEMAS["nested"], closing_bias, seed=i) for i in range(3)]
    mixed = run(jump_engine, cons[:2] + free + cons[2:], PROMPTS[:2] + PROMPTS[:3] + PROMPTS[2:3])
    assert [o["output_ids"] for o in mixed[2:5]] == [o["output_ids"] for o in alone]
    check_json(mixed[:2] + mixed[5:], [SCHEMAS["nested"]] * 3)


@pytest.mark.parametrize("jump", [True, False], ids=["jump", "plain"])
def test_overlap_gives_the_same_outputs(tiny_llama_path, jump, closing_bias):
    """Seeded sampling depends only on (seed, position): with the grammar barrier the overlap
    scheduler must produce exactly the non-overlapped outputs (a stale mask would not)."""
    params = [constrained("json_schema", s, closing_bias, seed=i)
              for i, s in enumerate(SCHEMAS.values())]
    params += [{"max_new_tokens": 16, "temperature": 0.0}] * 2
    results = []
    for overlap in (True, False):
        with engine(tiny_llama_path, disable_overlap_schedule=not overlap,
                    disable_jump_forward=not jump) as e:
            assert e.scheduler.overlap == overlap
            results.append(run(e, params))
    on, off = results
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    check_json(on[:4], list(SCHEMAS.values()))


@pytest.mark.parametrize("args,max_new", [
    # a small pool, and admission that over-commits: requests get retracted and come back
    (dict(max_total_tokens=160, schedule_conservativeness=0.02), 64),
    (dict(max_total_tokens=160, schedule_conservativeness=0.02, disable_jump_forward=True), 96),
    # prompts in chunks; jump-forward extends ride along with prefills
    (dict(chunked_prefill_size=8, enable_mixed_chunk=True), 96),
], ids=["retract-jump", "retract-plain", "chunked-mixed"])
def test_constrained_under_memory_pressure_and_chunking(tiny_llama_path, args, max_new,
                                                        closing_bias):
    # Admission reserves a new request's max_new_tokens in full: keep it well under the pool,
    # with schemas whose outputs are bounded. LONG_KEYS forces many tokens at once.
    schemas = [LONG_KEYS, FIXED_KEYS, BOUNDED_NESTED] * 4
    params = [constrained("json_schema", s, closing_bias, seed=i, max_new_tokens=max_new)
              for i, s in enumerate(schemas)]
    prompts = [p * (1 + i % 2) for i, p in enumerate(PROMPTS * 3)]
    with engine(tiny_llama_path, **args) as e:
        check_json(run(e, params, prompts), schemas)
        if "max_total_tokens" in args:
            assert e.scheduler.stats.num_retracted > 0
        else:
            assert e.scheduler.stats.num_mixed_batches > 0


# ---------------------------------------------------------------------- queue and errors
def test_invalid_grammars_are_rejected_at_entry(jump_engine):
    with pytest.raises(ValueError, match=r"^regex: .*parenthesis is not closed"):
        jump_engine.generate(prompt="a", sampling_params={"regex": "a(b"})
    with pytest.raises(ValueError, match=r"^ebnf: .*not defined"):
        jump_engine.generate(prompt="a", sampling_params={"ebnf": "root ::= foo"})
    with pytest.raises(ValueError, match="at most one of regex, json_schema, ebnf and structural_tag"):
        jump_engine.generate(prompt="a", sampling_params={"regex": "a", "ebnf": 'root ::= "a"'})
    assert not jump_engine.scheduler.live


def test_grammar_queue_timeout_abort_and_gauge(tiny_llama_path):
    """Compilation runs on the backend's pool: while it is busy, requests wait in the grammar
    queue (gauge), steps do not block, an abort there ends the request, and a compilation
    past the timeout finishes its request with an error naming the field."""
    from radixray.scheduler.request import Req
    from radixray.worker.sampling_params import SamplingParams

    with engine(tiny_llama_path, grammar_compile_timeout=0.3) as e:
        s = e.scheduler
        backend, gate = s.grammars.backend, threading.Event()
        real = backend._compile

        def compile_(kind, text):  # "...x" stands for a grammar that takes long to compile
            if text.endswith("x"):
                gate.wait()
            return real(kind, text)

        backend._compile = compile_
        ids = e.tokenizer.encode("hi")
        s.add_request(Req("slow", ids, SamplingParams(regex="[a-z]+x", max_new_tokens=8)))
        s.add_request(Req("gone", ids, SamplingParams(regex="[a-z]+y", max_new_tokens=8)))
        s.add_request(Req("free", ids, SamplingParams(max_new_tokens=3, temperature=0.0)))
        assert s.metrics()["num_grammar_queue_reqs"] == 2
        assert s.abort("gone")
        outs = []
        while s.has_work:
            outs += s.step()
        gate.set()
        s.check_invariant()
        final = {o.rid: o for o in outs if o.finished}
        assert final["gone"].finish_reason.message == "aborted by request"
        assert final["free"].completion_tokens == 3
        reason = final["slow"].finish_reason
        assert reason.type == "abort" and reason.message.startswith("regex: compilation timed out")
        assert reason.to_dict()["status_code"] == 400  # the client's grammar: a 400 on /v1
        assert s.metrics()["num_grammar_queue_reqs"] == 0


# ---------------------------------------------------------------------- HTTP
def test_http_constraints(tiny_llama_path, closing_bias):
    eng = make_engine(tiny_llama_path)
    try:
        with ServerThread(eng, tiny_llama_path) as url, httpx.Client(base_url=url,
                                                                     timeout=60) as client:
            r = client.post("/generate", json={"text": "a", "sampling_params": {"regex": "a(b"}})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["message"].startswith("sampling_params.regex: ")
            assert err["param"] == "sampling_params.regex"
            r = client.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "a", "regex": "a+",
                "response_format": {"type": "json_object"}})
            assert r.status_code == 400 and "at most one" in r.json()["message"]
            r = client.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "a",
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": {"type": "objec"}}}})
            err = r.json()
            assert r.status_code == 400 and err["param"] == "response_format" and "objec" in \
                err["message"]

            bias = {str(k): v for k, v in closing_bias.items()}
            r = client.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "JSON please"}],
                "max_tokens": MAX_NEW, "seed": 3, "logit_bias": bias,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": FIXED_KEYS}}})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), FIXED_KEYS)

            # streamed, jump-forward outputs carry several tokens: the text still adds up
            params = constrained("json_schema", SCHEMAS["nested"], closing_bias, seed=5)
            params["json_schema"] = json.dumps(SCHEMAS["nested"])
            with client.stream("POST", "/generate", json={
                    "text": "Data:", "sampling_params": params, "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: {")]
            final = events[-1]
            assert final["meta_info"]["finish_reason"]["type"] == "stop"
            jsonschema.validate(json.loads(final["text"]), SCHEMAS["nested"])
            assert len(events) < len(final["output_ids"])  # some outputs held several tokens
            assert eng.stats()["num_grammar_queue_reqs"] == 0  # the gauge /metrics exports
        wait_idle(eng)
    finally:
        eng.shutdown()


def test_serve_flags():
    import argparse

    from radixray.cluster.server_args import split_server_args
    from radixray.cluster.serve import add_serve_arguments, server_args_from
    from radixray.scheduler.config import SchedulerConfig

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    config = SchedulerConfig(**split_server_args(server_args_from(args))[0])
    assert not config.disable_jump_forward and config.grammar_compile_timeout == 30.0
    args = parser.parse_args(["--disable-jump-forward", "--grammar-compile-timeout", "5"])
    config = SchedulerConfig(**split_server_args(server_args_from(args))[0])
    assert config.disable_jump_forward and config.grammar_compile_timeout == 5.0
    with pytest.raises(ValueError, match="^grammar_compile_timeout: must be a positive"):
        SchedulerConfig(grammar_compile_timeout=0)


@pytest.mark.parametrize("body,off_loop", [
    (b'{"text": "a", "sampling_params": {"json_schema": "{}"}}', True),
    (b'{"messages": [], "response_format": {"type": "json_object"}}', True),
    (b'{"messages": [], "tools": []}', True),
    (b'{"text": "a", "sampling_params": {"max_new_tokens": 4}}', False),
])
def test_requests_with_a_grammar_are_prepared_off_the_event_loop(body, off_loop):
    """Checking a grammar parses it with xgrammar; a 70-byte schema kept it busy for tens of
    seconds on the replica's event loop (every request and /health waited). xgrammar releases
    the GIL, so in a worker thread the loop goes on."""
    import asyncio

    from radixray.cluster.generation import prepare_off_loop_if_large

    class Request:
        async def body(self):
            return body

    async def main():
        loop_thread = threading.get_ident()
        ran_in = await prepare_off_loop_if_large(Request(), threading.get_ident)
        return ran_in != loop_thread

    assert asyncio.run(main()) is off_loop
