"""Structural tags (SGLang's `response_format: {"type": "structural_tag", ...}` and native
`sampling_params.structural_tag`): free text until a trigger, then a tag whose content a JSON
schema constrains. Both formats: SGLang's (`structures`, `triggers`) and xgrammar's (`format`).
They were a 400 ("response_format.type: ...")."""

import json
import re

import httpx
import jsonschema
import pytest
from http_helpers import MODEL_NAME, ServerThread, make_engine, wait_idle

from radixray.scheduler.grammar import GrammarError, validate_grammar
from radixray.scheduler.grammar_compile import GrammarBackend

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
LEGACY = {"type": "structural_tag", "triggers": ["<function="],
          "structures": [{"begin": "<function=get_weather>", "schema": CITY,
                          "end": "</function>"}]}
SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"],
        "additionalProperties": False}
# xgrammar's format: one tag from the first token on, so a random model must produce it
FORCED = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": CITY},
    "end": "</call>"}}


@pytest.fixture(scope="module")
def backend(tiny_llama_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    backend = GrammarBackend(tokenizer, len(tokenizer))
    yield backend, tokenizer
    backend.shutdown()


def accepts(backend, tokenizer, tag, text) -> bool:
    state = backend.new_state(backend.compile("structural_tag", json.dumps(tag)))
    return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_sglangs_format_is_free_until_a_trigger_then_the_schema(backend):
    backend, tokenizer = backend
    assert accepts(backend, tokenizer, LEGACY, "Let me look. ")
    assert accepts(backend, tokenizer, LEGACY,
                   'Sure. <function=get_weather>{"city": "Oslo"}</function> done')
    assert not accepts(backend, tokenizer, LEGACY, 'Sure. <function=get_weather>{"town": 1}')
    assert not accepts(backend, tokenizer, LEGACY, "<function=get_weather>[1]")


@pytest.mark.parametrize("text, problem", [
    ("{}", "must have a format field"),
    ('{"type": "structural_tag", "format": {"type": "bogus"}}', "not recognized: bogus"),
    (json.dumps({**LEGACY, "triggers": "<function="}), "triggers a list of strings"),
    (json.dumps({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>"}]}),
     "structures[0] needs begin and end strings and a schema object"),
    ("not json", "not valid JSON"),
    (json.dumps({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>", "schema": {
        "type": "string", "pattern": "[a-z]{1,5000}"}}]}), "repetition counts above 1000"),
    # a schema no finite text satisfies, behind a trigger: its tag dispatch hid it from the
    # check, and once triggered the model ran to max_tokens
    (json.dumps({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>", "schema": SELF}]}),
     "structures[0].schema: no finite text satisfies root"),
    (json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f"], "tags": [{
            "begin": "<f>", "content": {"type": "json_schema", "json_schema": SELF},
            "end": "</f>"}]}}), "format.tags[0].content.json_schema: no finite text"),
    (json.dumps({**LEGACY, "format": FORCED["format"]}), "give either format"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # nested past the parser's depth
])
def test_bad_structural_tags_are_400s_naming_the_problem(text, problem):
    with pytest.raises(GrammarError, match=re.escape(problem)) as e:
        validate_grammar("structural_tag", text)
    assert str(e.value).startswith("structural_tag: ")


def test_served_over_openai_and_native_apis(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    try:
        with ServerThread(engine, tiny_llama_path) as url, httpx.Client(base_url=url,
                                                                        timeout=60) as c:
            for stream in (False, True):
                r = c.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": "weather:", "max_tokens": 40,
                    "temperature": 0.8, "seed": 3, "response_format": FORCED, "stream": stream})
                assert r.status_code == 200, r.text
                if stream:
                    events = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    text = "".join(e["choices"][0]["text"] for e in events)
                else:
                    text = r.json()["choices"][0]["text"]
                match = re.fullmatch(r"<call>(.*)</call>", text, re.S)
                assert match, text
                jsonschema.validate(json.loads(match.group(1)), CITY)
            r = c.post("/generate", json={"text": "weather:", "sampling_params": {
                "max_new_tokens": 40, "structural_tag": json.dumps(FORCED)}})
            assert r.status_code == 200 and r.json()["text"].startswith("<call>{"), r.text
            r = c.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "weather?"}],
                "max_tokens": 40, "response_format": LEGACY})
            assert r.status_code == 200, r.text  # free text: nothing to check but that it ran
            # a bad tag names the client's field, and one grammar at a time
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a",
                                                "response_format": {"type": "structural_tag"}})
            assert r.status_code == 400 and r.json()["param"] == "response_format", r.text
            r = c.post("/generate", json={"text": "a", "sampling_params": {
                "structural_tag": json.dumps(FORCED), "regex": "a+"}})
            assert r.status_code == 400 and "at most one of" in r.text, r.text
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a",
                                                "regex": "a+", "response_format": LEGACY})
            assert r.json()["message"] == ("response_format: at most one of regex, "
                                           "json_schema, ebnf and structural_tag may be given")
        with ServerThread(engine, tiny_llama_path, tool_call_parser="qwen25") as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                "response_format": LEGACY, "tool_choice": "required", "tools": [{
                    "type": "function", "function": {"name": "f", "parameters": {
                        "type": "object"}}}]})  # (it named response_format twice)
            assert r.status_code == 400 and r.json()["param"] == "tool_choice", r.text
            assert "a forced call cannot be combined with" in r.json()["message"]
        wait_idle(engine)
    finally:
        engine.shutdown()
