"""The OpenAI endpoints over HTTP, on what a probe found: bad text in tools or earlier calls is
a 400 (not a 500), continue_final_message and the validation of fields that only make sense
together, and streamed text_offset equal to the whole answer's."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from http_helpers import MODEL_NAME, client_fixture, post_stream, serving_fixtures, wait_scheduled

engine, server = serving_fixtures()
client = client_fixture()

USER = {"role": "user", "content": "write code"}
TOOL = {"type": "function", "function": {"name": "f", "description": "finds things",
                                         "parameters": {"type": "object"}}}


def chat(client: httpx.Client, **body) -> httpx.Response:
    # json.dumps escapes a lone surrogate as "\ud800", as a client's JSON would; httpx's json=
    # cannot encode it at all
    return client.post("/v1/chat/completions", headers={"content-type": "application/json"},
                       content=json.dumps({"model": MODEL_NAME, "max_tokens": 4,
                                           "messages": [USER], **body}))


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["param"] == param and r.json()["message"].startswith(param + ": "), r.text


@pytest.mark.parametrize("body,param", [
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "description": "\ud800"}}]},
     "tools[0].function.description"),
    ({"tools": [TOOL], "messages": [USER, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": '"\ud800"'}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, {"role": "tool", "tool_call_id": "\udc00", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"model": "\ud800"}, "model"),  # the 404 would quote it back
    ({"rid": "\ud800"}, "rid"),  # it becomes the answer's id
])
def test_text_the_tokenizer_cannot_encode_is_a_400_naming_it(client, body, param):
    assert_400(chat(client, **body), param)


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 0, "logprobs": False}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [USER], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [USER, {"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
])
def test_fields_that_need_another_field_are_400s(client, body, param):
    assert_400(chat(client, **body), param)


def test_completions_refuse_stream_options_without_stream(client):
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 1,
                                             "stream_options": {"include_usage": True}})
    assert_400(r, "stream_options")


def test_continue_final_message_continues_the_assistant_text(client, tiny_llama_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    prefill = [USER, {"role": "assistant", "content": "def fib(n):"}]
    ids = tok.encode(tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
                     + "def fib(n):", add_special_tokens=False)
    greedy = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/completions", json={**greedy, "prompt": ids}).json()
    for fields in ({"continue_final_message": True},
                   {"continue_final_message": True, "add_generation_prompt": False}):
        r = client.post("/v1/chat/completions", json={**greedy, "messages": prefill, **fields})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    kwargs = chat(client, chat_template_kwargs={"enable_thinking": False})  # the template
    assert kwargs.status_code == 200, kwargs.text  # ignores it; it must still be accepted


# ----------------------------------------------------------- streamed logprobs text_offset


def streamed_and_whole(client, body: dict):
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    events = post_stream(client, "/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    streamed = {key: [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]]
                for key in ("tokens", "token_logprobs", "text_offset")}
    return whole.json()["choices"][0], "".join(c["text"] for c in chunks), streamed


def assert_streamed_equals_whole(whole, text, streamed):
    assert text == whole["text"]
    assert streamed["tokens"] == whole["logprobs"]["tokens"]
    assert streamed["text_offset"] == whole["logprobs"]["text_offset"]
    for token, offset in zip(whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]):
        # skipped: part of a character; past a trimmed end; the BOS, listed but not echoed
        if "\ufffd" not in token and offset + len(token) <= len(text) and token != "<|bos|>":
            assert text[offset:].startswith(token)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_offsets_survive_text_held_back_for_a_stop_string(client, echo):
    body = {"model": MODEL_NAME, "prompt": "def fib(n):", "max_tokens": 24, "temperature": 0,
            "logprobs": 1, "echo": echo}
    tokens = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    tokens = tokens[-24:]  # the output's (echo lists the prompt's first)
    held = tokens[2][-1]
    assert sum(t.endswith(held) for t in tokens[:-1]) >= 1
    # a stop string that is never completed but whose first character ends tokens: each such
    # token's last character is held back and released with the next token's text
    whole, text, streamed = streamed_and_whole(client, {**body, "stop": held + "\u2603"})
    assert whole["finish_reason"] == "length"
    assert_streamed_equals_whole(whole, text, streamed)


def test_streamed_offsets_survive_characters_split_over_tokens(client):
    body = {"model": MODEL_NAME, "prompt": "marks = '", "max_tokens": 12, "temperature": 0.9,
            "seed": 11, "logprobs": 1, "regex": "(✓|日|é)+"}
    whole, text, streamed = streamed_and_whole(client, body)
    assert any("\ufffd" in t for t in whole["logprobs"]["tokens"])  # some token splits one
    assert_streamed_equals_whole(whole, text, streamed)


def test_an_aborted_completion_is_a_400_not_a_500(client, server, engine):
    """An /abort_request'ed /v1 request answered 500: the router retried it on another replica
    (running it again) and counted it against this one's circuit breaker."""
    import threading

    result = {}

    def long_request():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            result["r"] = c.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "x", "rid": "v1-abort", "max_tokens": 1500,
                "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_scheduled(engine, "v1-abort")
    assert client.post("/abort_request", json={"rid": "v1-abort"}).json()["aborted"]
    thread.join(30)
    r = result["r"]
    assert r.status_code == 400 and "request aborted: aborted by request" in r.text, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stop_regex_is_taken_as_sglang_takes_it(client, route):
    """SGLang's OpenAI requests have stop_regex; it was silently ignored here."""
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0}
    body |= ({"prompt": "def f(x):"} if route == "/v1/completions" else {"messages": [USER]})

    def text(answer):
        choice = answer["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content")), choice

    plain, _ = text(client.post(route, json=body).json())
    assert len(plain) >= 4
    pattern = re.escape(plain[2:4])
    cut, choice = text(client.post(route, json={**body, "stop_regex": [pattern]}).json())
    assert choice["finish_reason"] == "stop" and cut == plain[:re.search(pattern, plain).start()]
    r = client.post(route, json={**body, "stop_regex": "a("})
    assert r.status_code == 400 and r.json()["param"] == "stop_regex", r.text
