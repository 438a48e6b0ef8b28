"""Chat prompts without a server (cluster/chat_prompt.py): continuing the final message,
template variables, and 400s that name the field holding text the tokenizer cannot encode."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from radixray.cluster.chat_prompt import chat_prompt_ids, check_strings
from radixray.cluster.api_errors import APIError
from radixray.cluster.openai_api import ChatCompletionRequest, tool_plan

USER = {"role": "user", "content": "write code"}


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture
def templated(tiny_llama_path):
    """A fresh tokenizer with its chat template replaced."""
    def make(template: str):
        fresh = AutoTokenizer.from_pretrained(tiny_llama_path)
        fresh.chat_template = template
        return fresh
    return make


def request(messages=(USER,), **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages),
                                                 **fields})


def prompt(tok, body) -> str:
    return tok.decode(chat_prompt_ids(body, tok))


def rejected(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    assert caught.value.message.startswith(caught.value.param + ": ")  # the same field
    return caught.value


@pytest.mark.parametrize("content", ["def fib(n):", "", "ends in a newline\n"])
def test_continuing_cuts_the_prompt_right_after_the_final_message(tok, content):
    body = request([USER, {"role": "assistant", "content": content}],
                   continue_final_message=True)
    # ChatML: what the generation prompt would open, then the message's text, unclosed
    expected = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert prompt(tok, body) == expected + content
    plain = prompt(tok, request([USER, {"role": "assistant", "content": content}]))
    assert plain.endswith("<|im_end|>\n<|im_start|>assistant\n")  # a new turn without it
    same = request([USER, {"role": "assistant", "content": content}],
                   continue_final_message=True, add_generation_prompt=False)
    assert prompt(tok, same) == expected + content


def test_continuing_under_a_trimming_template_cuts_where_transformers_does(templated):
    """Llama 3's and Gemma's templates trim a message's content: the continued prompt kept
    the trailing space transformers' own continue_final_message drops ("The answer is ")."""
    trimming = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    keeping = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    messages = [USER, {"role": "assistant", "content": "The answer is "}]
    for template in (trimming, keeping):
        tok = templated(template)
        ours = prompt(tok, request(messages, continue_final_message=True))
        theirs = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert ours == theirs, (template, ours, theirs)
    assert ours.endswith("is ")  # kept where the template keeps it


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(tok):
    assert prompt(tok, request(add_generation_prompt=False)) == \
        tok.apply_chat_template([USER], tokenize=False)
    assert prompt(tok, request()).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages,fields,fragment", [
    ([USER], {"continue_final_message": True}, "must be an assistant message"),
    ([USER, {"role": "assistant", "content": "a"}],
     {"continue_final_message": True, "add_generation_prompt": True}, "cannot be combined"),
])
def test_continuing_needs_an_assistant_message_and_no_generation_prompt(tok, messages, fields,
                                                                        fragment):
    err = rejected(lambda: chat_prompt_ids(request(messages, **fields), tok))
    assert err.param == "continue_final_message" and fragment in err.message


def test_a_template_that_never_writes_the_content_cannot_be_continued(templated):
    tok = templated("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    body = request([USER, {"role": "assistant", "content": "a"}], continue_final_message=True)
    assert rejected(lambda: chat_prompt_ids(body, tok)).param == "continue_final_message"


def test_chat_template_kwargs_are_template_variables(templated):
    tok = templated("{{ 'T' if enable_thinking else 'N' }}"
                    "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert prompt(tok, request(chat_template_kwargs={"enable_thinking": True})) == "Twrite code"
    assert prompt(tok, request(chat_template_kwargs={"enable_thinking": False})) == "Nwrite code"
    assert prompt(tok, request()) == "Nwrite code"


@pytest.mark.parametrize("name", ["tokenize", "chat_template", "messages", "tools",
                                  "add_generation_prompt"])
def test_kwargs_that_would_change_the_call_itself_are_400s(tok, name):
    err = rejected(lambda: chat_prompt_ids(request(chat_template_kwargs={name: True}), tok))
    assert err.param == "chat_template_kwargs" and repr(name) in err.message


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": "a", "name": "\ud800"}, "messages[1].name"),
    ({"role": "tool", "content": "a", "tool_call_id": "c\udfff"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": [{"type": "text", "text": "\ud800"}]}, "messages[1].content"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "f", "arguments": '{"city": "\ud800"}'}}]},
     "messages[1].tool_calls[0].function.arguments.city"),
    # the arguments string is clean; the surrogate is escaped inside its JSON
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "f", "arguments": '{"city": "\\ud800"}'}}]},
     "messages[1].tool_calls[0].function.arguments.city"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "f", "arguments": "not json \ud800"}}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_a_lone_surrogate_in_a_message_names_its_field(tok, message, param):
    assert rejected(lambda: chat_prompt_ids(request([USER, message]), tok)).param == param


def test_a_lone_surrogate_in_kwargs_or_tools_names_its_field(tok):
    body = request(chat_template_kwargs={"x": ["ok", {"y": "\udc80"}]})
    assert rejected(lambda: chat_prompt_ids(body, tok)).param == "chat_template_kwargs.x[1].y"
    tool = {"type": "function", "function": {
        "name": "f", "description": "ok", "parameters": {
            "type": "object", "properties": {"city": {"description": "\ud800"}}}}}
    err = rejected(lambda: tool_plan(request(tools=[tool]), None))
    assert err.param == "tools[0].function.parameters.properties.city.description"
    bad_key = {"type": "function", "function": {"name": "f", "parameters": {"\ud800": 1}}}
    assert rejected(lambda: tool_plan(request(tools=[tool, bad_key]), None)).param == \
        "tools[0].function.parameters.properties.city.description"
    assert rejected(lambda: tool_plan(request(tools=[bad_key]), None)).param == \
        "tools[0].function.parameters"  # a key is named by its object


def test_errors_about_tools_name_the_exact_field(tok):
    bad = {"type": "function", "function": {"name": "no spaces"}}
    assert rejected(lambda: tool_plan(request(tools=[bad]), None)).param == \
        "tools[0].function.name"


def test_deep_nesting_is_checked_without_recursion():
    deep = "\ud800"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(APIError) as caught:
        check_strings(deep, "x")
    assert caught.value.param == "x" + "[0]" * 5000


class EncodeFails:
    """The tiny tokenizer, but encoding fails as the fast tokenizer does on text it rejects."""

    def __init__(self, tok):
        self.tok, self.chat_template = tok, tok.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.tok.apply_chat_template(*args, **kwargs)

    def encode(self, text, **kwargs):
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")


def test_a_tokenizer_type_error_is_a_400(tok):
    err = rejected(lambda: chat_prompt_ids(request(), EncodeFails(tok)))
    assert err.param == "messages" and "cannot be tokenized" in err.message


def test_a_tokenizer_without_a_chat_template_says_so(templated):
    """The 400 said the template "rejected" the messages: there was no template at all."""
    err = rejected(lambda: chat_prompt_ids(request(), templated(None)))
    assert err.param == "messages" and "has no chat template" in err.message


def test_an_earlier_replys_reasoning_content_reaches_the_template(templated):
    """It was dropped as an unknown field: Qwen3 / DeepSeek-R1 style templates, which show or
    strip an earlier reply's thinking, rendered a different prompt than transformers."""
    tok = templated("{% for m in messages %}{% if m.reasoning_content %}<think>"
                    "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}")
    body = request([USER, {"role": "assistant", "content": "ok", "reasoning_content": "hm"},
                    USER])
    assert prompt(tok, body) == "write code|<think>hm</think>ok|write code|"
    bad = request([USER, {"role": "assistant", "content": "ok", "reasoning_content": "\ud800"}])
    assert rejected(lambda: chat_prompt_ids(bad, tok)).param == "messages[1].reasoning_content"


def test_serve_reads_a_chat_template_file_and_the_replica_uses_it(tmp_path, tiny_llama_path):
    """Models whose shipped template does not take OpenAI-style messages (DeepSeek-V3's joins
    an earlier call's arguments as a string) had no way out: SGLang and vLLM take
    --chat-template; so does serve now, checked at start and sent to the replicas."""
    import httpx
    from http_helpers import MODEL_NAME, ServerThread, make_engine

    from radixray.cluster.chat_prompt import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    template = read_chat_template(str(path))
    for text, problem in (("{% for m in messages %}", "line 1: Unexpected end of template"),
                          ("  ", "is empty")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"^chat_template: .*{problem}"):
            read_chat_template(str(path))
    with pytest.raises(ValueError, match="^chat_template: cannot read"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    engine = make_engine(tiny_llama_path)
    try:
        with ServerThread(engine, tiny_llama_path, chat_template=template) as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": [USER], "max_tokens": 1})
            tok = AutoTokenizer.from_pretrained(tiny_llama_path)
            expected = tok.encode("[user] write code\n[assistant] ", add_special_tokens=False)
            assert r.json()["usage"]["prompt_tokens"] == len(expected), r.text
    finally:
        engine.shutdown()
