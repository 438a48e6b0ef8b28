"""OpenAI tool calling: the parsers read each family's format back (and nothing else), a
streamed reply never sends call text as content, and through the server a forced call
(tool_choice required / named) comes back as ``tool_calls`` whose arguments satisfy the
function's schema, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest

from http_helpers import MODEL_NAME, post_stream, serving_fixtures, wait_idle
from radixray.cluster.tool_calls import (HermesParser, Llama3JsonParser, ToolCall, ToolStream,
                                         plan_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text,content,calls", [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>', "Let me look.", [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "",
     [("get_time", {"zone": "UTC"}), ("get_weather", {})]),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None, []),  # not offered
    ('Sure.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone, and more.',
     "Sure.\nDone, and more.", [("get_time", {})]),  # text after a call stays content
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>\n<tool_call>{"name": '
     '"get_time", "arguments": {}}</tool_call>',  # a block that is no call stays text
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {</tool_call>', None, []),  # bad JSON
    ("just text, <tool_ no call", None, []),
    # the end tag inside a string argument: the call was lost to raw text
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "</tool_call>"}}</tool_call>', "",
     [("get_time", {"zone": "</tool_call>"})]),
    # leading newlines stay, as the stream already sent them
    ('\n\nSure thing.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "\n\nSure thing.", [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nafter', "after",
     [("get_time", {})]),
])
def test_hermes_parser(text, content, calls):
    got_content, got = HermesParser().parse(text, NAMES)
    assert got == [ToolCall(n, a) for n, a in calls]
    assert got_content == (text if content is None else content)


@pytest.mark.parametrize("text,calls", [
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', [("get_time", {"zone": "CET"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
     '"parameters": {"city": "Paris"}}', [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    ('{"name": "get_time", "parameters": {}} and then some words', []),
    ("The weather is fine.", []),
])
def test_llama3_parser(text, calls):
    content, got = Llama3JsonParser().parse(text, NAMES)
    assert got == [ToolCall(n, a) for n, a in calls]
    assert content == ("" if calls else text)


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), 'Checking <tool> tags first.  \n<tool_call>\n{"name": "get_time", '
                     '"arguments": {"zone": "UTC"}}\n</tool_call>'),
    (HermesParser(), "No call here, only a <tool_ that never completes."),
    (HermesParser(), 'Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call> bye'),
    (HermesParser(), '\n\nSure thing.\n<tool_call>{"name": "get_time", "arguments": '
                     '{"zone": "</tool_call>"}}</tool_call>'),
    (Llama3JsonParser(), '  {"name": "get_time", "parameters": {"zone": "UTC"}}'),
    (Llama3JsonParser(), "Plain answer {with braces}."),
])
def test_streamed_content_never_includes_call_text(parser, text):
    """Fed a character at a time, the content deltas add up to the parsed content, and no
    delta ever has to be taken back."""
    stream, sent = ToolStream(parser, NAMES), ""
    for end in range(1, len(text) + 1):
        sent += stream.update(text[:end])
    rest, calls = stream.finish(text)
    content, want = parser.parse(text, NAMES)
    assert sent + rest == content and calls == want


@pytest.mark.parametrize("tools,choice,parser,error", [
    (None, "required", "qwen25", "tool_choice: give tools"),
    ([WEATHER, WEATHER], "auto", "qwen25", "tools: function names must be unique"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", None,
     "tools[0].function.name"),
    ([WEATHER], "required", None, "tool_choice: forcing a call needs"),
    # arguments are an object: an array schema was accepted and its call came back as text
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}], "auto", "qwen25",
     "tools[1].function.parameters: must be a JSON schema of an object"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "qwen25",
     "tool_choice.function.name: 'get_time' is not among the tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     "required", "qwen25", "tools[0].function.parameters: must be a JSON schema of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}],
     "required", "qwen25", "tools: a function's parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {  # can never finish
        "type": "object", "required": ["n"], "properties": {"n": {"$ref": "#"}}}}}],
     "required", "qwen25", "tools: a function's parameters are not a usable JSON schema "
                           "(ebnf: no finite text"),
])
def test_plan_errors_name_the_field(tools, choice, parser, error):
    with pytest.raises(ValueError, match=f"^{error}".replace("[", r"\[").replace("(", r"\(")):
        plan_tools(tools, choice, parser)


def test_plans():
    assert plan_tools([WEATHER], "none", "qwen25").template_tools is None
    auto = plan_tools([WEATHER], None, "qwen25")
    assert auto.template_tools == [WEATHER] and auto.forced_ebnf is None
    assert plan_tools([WEATHER], "auto", None).parser is None  # shown, replies stay text
    assert "get_weather" in plan_tools([WEATHER, TIME], "required", "llama3").forced_ebnf


def test_at_most_one_call_without_parallel_calls():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    plan = plan_tools([WEATHER, TIME], "auto", "qwen25")
    assert [c.name for c in plan.parse(text)[1]] == ["get_time", "get_weather"]
    plan.max_calls = 1
    assert [c.name for c in plan.parse(text)[1]] == ["get_time"]
    stream = ToolStream(plan.parser, plan.names, plan.max_calls)
    assert [c.name for c in stream.finish(text)[1]] == ["get_time"]


@pytest.mark.parametrize("parser,call", [
    ("qwen25", '<tool_call>\n{"name": "order", "arguments": {"item": {"sku": "a1", '
               '"parts": [{"sku": "b", "parts": []}]}, "qty": 2}}\n</tool_call>'),
    ("llama3", '{"name": "order", "parameters": {"item": {"sku": "z", "parts": []}, "qty": 1}}'),
])
def test_forced_call_keeps_the_tools_own_references(parser, call):
    """Pydantic writes nested models as ``$defs`` and ``#/$defs/...`` references (recursive
    here); forcing a call of such a tool must resolve them against the tool's parameters."""
    import xgrammar as xgr

    item = {"type": "object", "required": ["sku", "parts"], "properties": {
        "sku": {"type": "string"}, "parts": {"type": "array",
                                             "items": {"$ref": "#/$defs/Item"}}}}
    order = {"type": "function", "function": {"name": "order", "parameters": {
        "type": "object", "required": ["item", "qty"], "$defs": {"Item": item},
        "properties": {"item": {"$ref": "#/$defs/Item"}, "qty": {"type": "integer"}}}}}
    for tools in ([order], [order, TIME]):
        ebnf = plan_tools(tools, "required", parser).forced_ebnf
        chars = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(chars).compile_grammar(ebnf))
        assert matcher.accept_string(call) and matcher.is_completed()
        assert not xgr.GrammarMatcher(xgr.GrammarCompiler(chars).compile_grammar(ebnf)) \
            .accept_string(call.replace('"sku": "a1"', '"sku": 5').replace('"z"', "7"))


# ---------------------------------------------------------------- through the server


engine, server = serving_fixtures(tool_call_parser="qwen25")


def chat(server, **body):
    body = {"model": MODEL_NAME, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "weather in Oslo?"}], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def check_call(call: dict, name: str) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
    assert set(args) == set(schema["required"])
    assert all(args[k] in schema["properties"][k]["enum"] for k in args)
    return args


@pytest.mark.parametrize("choice,name", [
    ("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_a_forced_call_comes_back_as_tool_calls(server, engine, choice, name):
    r = chat(server, tools=[WEATHER, TIME], tool_choice=choice)
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    args = check_call(call, name or call["function"]["name"])
    # streamed: the same call, once, in the last chunk, and no call text as content
    events = post_stream(httpx.Client(base_url=server.url, timeout=60), "/v1/chat/completions",
                         {"model": MODEL_NAME, "max_tokens": 64, "temperature": 0,
                          "messages": [{"role": "user", "content": "weather in Oslo?"}],
                          "tools": [WEATHER, TIME], "tool_choice": choice, "stream": True})
    deltas = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    streamed = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert len(streamed) == 1 and streamed[0]["index"] == 0
    assert check_call(streamed[0], call["function"]["name"]) == args
    assert deltas[-1]["finish_reason"] == "tool_calls"
    wait_idle(engine)


def test_tools_reach_the_template_and_a_conversation_with_calls_renders(server, engine):
    plain = chat(server, max_tokens=1).json()["usage"]["prompt_tokens"]
    shown = chat(server, max_tokens=1, tools=[WEATHER]).json()["usage"]["prompt_tokens"]
    hidden = chat(server, max_tokens=1, tools=[WEATHER], tool_choice="none").json()
    assert shown > plain == hidden["usage"]["prompt_tokens"]
    history = [{"role": "user", "content": "weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather",
                       "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"}]
    r = chat(server, messages=history, tools=[WEATHER], max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > shown
    wait_idle(engine)


@pytest.mark.parametrize("body,error", [
    ({"tool_choice": "required"}, "tool_choice: give tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"},
     "tool_choice: a forced call cannot be combined"),
    # a stop inside the call's JSON cut it, and the call came back as raw text
    ({"tools": [WEATHER], "tool_choice": "required", "stop": "}"},
     "tool_choice: a forced call cannot be combined with stop"),
    ({"tools": [WEATHER], "stop": ["x", "y"],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice: a forced call cannot be combined with stop"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "stop_token_ids": [5]},
     "tool_choice: a forced call cannot be combined with stop, stop_regex or stop_token_ids"),
    # the most specific error, not the union's first member's ("Input should be 'none'...")
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": None}}},
     "tool_choice.function.name: "),
    # an earlier call that is no call: the template's error named no field
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": True}]}]},
     "messages[1].tool_calls[0].function: must be an object"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {
                        "name": "get_time", "arguments": 7}}]}]},
     "messages[1].tool_calls[0].function.arguments: must be a JSON string"),
    # OpenAI's deprecated function calling was silently ignored
    ({"functions": [WEATHER["function"]]}, "functions: deprecated by OpenAI"),
    ({"function_call": "auto"}, "function_call: deprecated by OpenAI"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                    "function_call": {"name": "get_time", "arguments": "{}"}}]},
     "messages[1].function_call: deprecated by OpenAI"),
])
def test_bad_tool_requests_are_400s(server, engine, body, error):
    r = chat(server, **body)
    assert r.status_code == 400 and error in r.json()["message"], r.text
    wait_idle(engine)


def test_the_openai_client_reads_the_calls(server, engine):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = dict(model=MODEL_NAME, max_tokens=64, temperature=0, tools=[WEATHER, TIME],
              messages=[{"role": "user", "content": "weather?"}],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = client.chat.completions.create(**kw).choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    streamed = [d.tool_calls for chunk in client.chat.completions.create(stream=True, **kw)
                for d in [chunk.choices[0].delta] if chunk.choices and d.tool_calls]
    assert [c.function.arguments for calls in streamed for c in calls] == \
        [call.function.arguments]
    wait_idle(engine)


def test_call_arguments_keep_their_characters():
    """They were re-serialised with \\u escapes ("Z\\u00fcrich")."""
    call = ToolCall("get_time", {"zone": "Zürich 東京"}).to_openai()
    assert call["function"]["arguments"] == '{"zone": "Zürich 東京"}'


def test_a_parser_reads_call_tags_a_tokenizer_marks_special(tiny_llama_path):
    """skip_special_tokens (the default) stripped the tags of tokenizers that register
    <tool_call> as a special token (some Hermes checkpoints), so no call was ever parsed."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from radixray.cluster.openai_api import ChatCompletionRequest, chat_requests

    ctx = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(tiny_llama_path),
                          context_len=2048, vocab_size=2048, pool_tokens=None,
                          tool_call_parser="qwen25")
    messages = [{"role": "user", "content": "time?"}]
    for tools, keeps in ((None, False), ([TIME], True)):
        body = ChatCompletionRequest.model_validate(
            {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "tools": tools})
        req, _, _ = chat_requests(body, ctx)
        assert req.sampling_params.skip_special_tokens is not keeps


def test_json_nested_too_deep_is_no_call_and_no_crash():
    """json.loads raises RecursionError, not ValueError, past ~1,000 levels: a chat history
    with such arguments was a 500, and a reply with such a block would have been too."""
    from radixray.cluster.tool_calls import PARSERS, _parsed_arguments

    deep = "[" * 5000 + "]" * 5000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    assert _parsed_arguments(call) == call  # left as the client wrote it
    content, calls = PARSERS["hermes"]().parse(
        f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>', {"f"})
    assert calls == []
