"""The official ``openai`` client against a running server over the in-process engine:
completions, chat (the tokenizer's chat template), streaming, n > 1, logprobs, stop, seed and
usage. Every test ends with the scheduler idle and its memory invariant holding."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from http_helpers import MODEL_NAME, post_stream, serving_fixtures, wait_idle


engine, server = serving_fixtures()


@pytest.fixture
def client(server, engine):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()
    wait_idle(engine)


def test_models_list(client, tiny_llama_path):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["root"] == tiny_llama_path
    # "retrieve model", by name or by path (SGLang's /v1/models/{model:path})
    assert client.models.retrieve(MODEL_NAME) == models[0]
    assert client.models.retrieve(tiny_llama_path).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_completion_matches_native_generate(client, server):
    c = client.completions.create(model=MODEL_NAME, prompt="def main():", max_tokens=10,
                                  temperature=0)
    assert c.object == "text_completion" and c.model == MODEL_NAME
    choice = c.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    native = httpx.post(server.url + "/generate", json={
        "text": "def main():", "sampling_params": {"max_new_tokens": 10, "temperature": 0}},
        timeout=60).json()
    assert choice.text == native["text"]
    n_prompt = len(server.tokenizer.encode("def main():"))
    assert c.usage.prompt_tokens == n_prompt
    assert c.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    assert c.usage.total_tokens == n_prompt + c.usage.completion_tokens
    # the native request reused the completion's prompt
    assert native["meta_info"]["cached_tokens"] == n_prompt - 1
    again = client.completions.create(model=MODEL_NAME, prompt="def main():", max_tokens=10,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == n_prompt - 1


def test_completion_batch_prompts_and_token_ids(client, server):
    tok = server.tokenizer
    c = client.completions.create(model=MODEL_NAME, prompt=["import os", "class A:"],
                                  max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1]
    assert c.usage.completion_tokens == 8
    ids = client.completions.create(model=MODEL_NAME, prompt=tok.encode("import os"),
                                    max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == c.choices[0].text
    # one id for the whole answer, streamed too (not the first prompt's sub-request's)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", c.id), c.id
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=[[5, 6], [7, 8]],
                                              max_tokens=2, stream=True))
    assert {re.fullmatch(r"cmpl-[0-9a-f]{32}", ch.id) is not None for ch in streamed} == {True}
    assert len({ch.id for ch in streamed}) == 1


def test_chat_uses_the_chat_template(client, server):
    tok = server.tokenizer
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                       temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    native = httpx.post(server.url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        timeout=60).json()
    assert msg.content == native["text"]
    # content given as text parts is the same prompt
    parts = [{"role": "system", "content": [{"type": "text", "text": "You write Python."}]},
             {"role": "user", "content": [{"type": "text", "text": "Say "},
                                          {"type": "text", "text": "hi"}]}]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=8,
                                        temperature=0)
    assert r2.choices[0].message.content == msg.content


def test_roles_the_template_does_not_know_become_the_ones_it_does(client, server):
    """The test model's template compares no role, so "developer" is templated as "system"
    and the deprecated "function" (a function's result) as "tool"."""
    def prompt_tokens(messages):
        return client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                              max_tokens=1).usage.prompt_tokens

    tok = server.tokenizer
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_tool = [{"role": "user", "content": "weather?"},
               {"role": "tool", "content": "sunny", "name": "get_weather"}]
    for messages in (as_system, as_tool):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt_tokens(messages) == len(tok.encode(text, add_special_tokens=False))
    assert prompt_tokens([{**as_system[0], "role": "developer"}, as_system[1]]) == \
        prompt_tokens(as_system)
    assert prompt_tokens([as_tool[0], {**as_tool[1], "role": "function"}]) == \
        prompt_tokens(as_tool)


def test_streaming_equals_non_streamed(client):
    for kwargs in [dict(max_tokens=30), dict(max_tokens=30, stop=["\n", "("]),
                   dict(max_tokens=40, extra_body={"ignore_eos": True})]:
        full = client.completions.create(model=MODEL_NAME, prompt="def f(x):", temperature=0,
                                         **kwargs)
        chunks = list(client.completions.create(
            model=MODEL_NAME, prompt="def f(x):", temperature=0, stream=True,
            stream_options={"include_usage": True}, **kwargs))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == full.choices[0].text
        finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finals[-1] == full.choices[0].finish_reason and set(finals[:-1]) <= {None}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
            full.usage.completion_tokens
        if "stop" in kwargs:
            assert "\n" not in text and "(" not in text

    messages = [{"role": "user", "content": "write a loop"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                 max_tokens=30, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_a_streams_chunks_share_one_created_and_carry_usage(server, monkeypatch):
    """Chunks took `created` from the clock each (a stream crossing a second had two), and chat
    chunks had no `usage` key where OpenAI's carry null before the usage chunk."""
    import itertools
    from types import SimpleNamespace

    from radixray.cluster import openai_responses, openai_serving

    clock = SimpleNamespace(time=itertools.count(1_700_000_000).__next__)  # a second per call
    monkeypatch.setattr(openai_serving, "time", clock)
    monkeypatch.setattr(openai_responses, "time", clock)
    common = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body in (("/v1/completions", {"prompt": "def f(x):"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            events = [e for e in post_stream(http, path, {**common, **body}) if e != "[DONE]"]
            assert len(events) >= 3, events
            assert len({e["created"] for e in events}) == 1, (path, events)
            assert all("usage" in e for e in events), path
            assert [e["usage"] is None for e in events] == [True] * (len(events) - 1) + [False]
            # continuous_usage_stats (vLLM's, SGLang's) was dropped without a word: every chunk
            # now carries its choice's usage so far, rising to the final count
            opts = {"include_usage": True, "continuous_usage_stats": True}
            events = [e for e in post_stream(http, path, {**common, **body,
                                                          "stream_options": opts})
                      if e != "[DONE]"]
            counts = [e["usage"]["completion_tokens"] for e in events]
            assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6, counts
            assert len({e["usage"]["prompt_tokens"] for e in events}) == 1


def test_n_copies_share_the_prompt_and_differ(client, server):
    prompt = "def handle_request(self, request):\n    "
    n_prompt = len(server.tokenizer.encode(prompt))
    c = client.completions.create(model=MODEL_NAME, prompt=prompt, n=2, max_tokens=8,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in c.choices) == [0, 1]
    assert c.usage.prompt_tokens == n_prompt  # counted once per prompt
    assert c.usage.completion_tokens == 16
    # cached tokens, part of the prompt, count once per prompt as the prompt does, and are the
    # prompt's own hit: at most a common opening for a new prompt (the copies' hit on their
    # warm-up is not one)
    assert c.usage.prompt_tokens_details.cached_tokens < n_prompt - 1
    other = "import os  # the other prompt of the usage test"
    usage = list(client.completions.create(
        model=MODEL_NAME, prompt=[prompt, other], n=3, max_tokens=2, stream=True,
        stream_options={"include_usage": True}))[-1].usage
    n_other = len(server.tokenizer.encode(other))
    assert usage.prompt_tokens == n_prompt + n_other
    # the first prompt is known now; the other one is new (at most a common opening hits)
    assert n_prompt - 1 <= usage.prompt_tokens_details.cached_tokens < n_prompt - 1 + n_other - 1
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi, n=2 usage check"}], n=2,
        max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content != chat.choices[1].message.content
    # the chat template's opening may be cached from earlier chats; the message is new
    assert chat.usage.prompt_tokens_details.cached_tokens < chat.usage.prompt_tokens - 1
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, n=2,
                                              max_tokens=8, temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for ch in streamed:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1]  # greedy copies agree


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt="import", max_tokens=12,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_logprobs(client, server):
    tok = server.tokenizer
    c = client.completions.create(model=MODEL_NAME, prompt="for x in", max_tokens=5,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert top[token] == pytest.approx(value)  # greedy: the chosen token is in the top 3
        assert max(top.values()) == pytest.approx(value)

    # echo prepends the prompt and its logprobs (the first one null)
    e = client.completions.create(model=MODEL_NAME, prompt="for x in", max_tokens=2,
                                  temperature=0, logprobs=0, echo=True,
                                  extra_body={"ignore_eos": True})
    n_prompt = len(tok.encode("for x in"))
    assert e.choices[0].text.startswith("for x in")
    assert len(e.choices[0].logprobs.token_logprobs) == n_prompt + 2
    assert e.choices[0].logprobs.token_logprobs[0] is None

    # each text offset points at its token in the echoed text; the BOS is in neither
    text, lp = e.choices[0].text, e.choices[0].logprobs
    visible = [tok.decode([t], skip_special_tokens=True) for t in tok.encode("for x in")]
    visible += lp.tokens[n_prompt:]
    assert all(text[off:].startswith(v) for off, v in zip(lp.text_offset, visible))
    assert lp.text_offset[n_prompt] == len("for x in")

    # A token-id prompt is echoed as its ids decode with special tokens kept, so the BOS is
    # in the text and every token (the BOS too) is where its offset says.
    ids = tok.encode("for x in")
    e = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0,
                                  logprobs=0, echo=True, extra_body={"ignore_eos": True})
    text, lp = e.choices[0].text, e.choices[0].logprobs
    assert text.startswith(tok.bos_token + "for x in") and lp.tokens[0] == tok.bos_token
    assert all(text[off:].startswith(t) for off, t in zip(lp.text_offset, lp.tokens))
    # A special token the client wrote in a text prompt is in its echo: it has its width.
    prompt = "<|im_start|>user\nfor x in"
    e = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                  temperature=0, logprobs=0, echo=True,
                                  extra_body={"ignore_eos": True})
    text, lp = e.choices[0].text, e.choices[0].logprobs
    assert text.startswith(prompt) and lp.tokens[:2] == [tok.bos_token, "<|im_start|>"]
    assert lp.text_offset[:3] == [0, 0, len("<|im_start|>")]  # the added BOS: zero-width
    assert all(text[off:].startswith(t) for off, t in zip(lp.text_offset[1:], lp.tokens[1:]))

    r = client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(x.token for x in content) == r.choices[0].message.content
    for x in content:
        assert len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == pytest.approx(x.logprob)
        assert bytes(x.bytes).decode() == x.token


@pytest.mark.parametrize("as_ids", [False, True])
def test_streamed_echo_lists_the_prompt_logprobs_as_the_answer_does(server, as_ids):
    prompt = server.tokenizer.encode("for x in") if as_ids else "for x in"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        events = post_stream(c, "/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    want = whole["choices"][0]
    assert "".join(ch["text"] for ch in chunks) == want["text"]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [x for ch in chunks for x in ch["logprobs"][key]] == want["logprobs"][key], key
    prompt_len = len(want["logprobs"]["tokens"]) - 6
    listed = list(zip(want["logprobs"]["text_offset"], want["logprobs"]["tokens"]))[:prompt_len]
    assert all(want["text"][off:].startswith(t) for off, t in listed[0 if as_ids else 1:])


def test_chat_logprob_bytes_are_each_tokens_own(client):
    """"é" is two byte-level tokens here (0xC3, 0xA9): each decodes alone to U+FFFD, but their
    ``bytes`` are their own and join into the character."""
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"regex": "é"})
    assert r.choices[0].message.content == "é"
    content = r.choices[0].logprobs.content
    assert [x.bytes for x in content[:2]] == [[0xC3], [0xA9]]
    assert content[0].token == "\ufffd"  # the token text stays as it decodes
    for x in content:
        assert all(top.bytes and (top.token != x.token or top.bytes == x.bytes)
                   for top in x.top_logprobs)


def test_best_of_returns_the_most_likely_candidates(client):
    """best_of candidates are the n=best_of copies (the same seeds); the answer keeps the n with
    the highest logprob per token, best first, and bills every candidate's tokens."""
    kw = dict(model=MODEL_NAME, prompt="def", max_tokens=4, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=3, logprobs=0, **kw)
    score = {c.text: sum(c.logprobs.token_logprobs) / 4 for c in every.choices}
    assert len(score) == 3  # distinct candidates, so the ranking shows
    best = client.completions.create(n=2, best_of=3, **kw)
    assert [c.text for c in best.choices] == sorted(score, key=score.get, reverse=True)[:2]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 12
    assert best.usage.prompt_tokens == every.usage.prompt_tokens
    same = client.completions.create(n=2, best_of=2, stream=True, **kw)  # best_of == n: n
    assert len({ch.choices[0].index for ch in same if ch.choices}) == 2


def test_sglang_extras_are_honoured(client, server):
    tok = server.tokenizer
    c = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 20, "top_k": 1,
                                              "repetition_penalty": 1.1, "min_p": 0.0,
                                              "rid": "extras-1", "priority": 3,
                                              "cache_salt": "tenant-a"})
    assert c.id == "cmpl-extras-1"
    assert c.usage.completion_tokens == 20
    # a different cache salt never shares a prefix with the first one
    salted = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=1,
                                       extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    same = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=1,
                                     extra_body={"cache_salt": "tenant-a"})
    assert same.usage.prompt_tokens_details.cached_tokens == same.usage.prompt_tokens - 1 > 0
    # extra_key and cache_salt both count (the salt was dropped when both came), and a salt
    # never stands for someone else's bare extra_key
    def cached(**extra):
        return client.completions.create(model=MODEL_NAME, prompt="def salted", max_tokens=1,
                                         extra_body=extra).usage.prompt_tokens_details.cached_tokens
    assert cached(extra_key="k", cache_salt="s1") == 0
    assert cached(extra_key="k", cache_salt="s2") == 0
    assert cached(extra_key="s1") == 0
    assert cached(extra_key="k", cache_salt="s1") > 0
    # stop_token_ids: stop at the first generated token, which is not shown
    first = tok.encode(c.choices[0].text, add_special_tokens=False)[0]
    s = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [first]})
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].model_extra["matched_stop"] == first
    assert s.choices[0].text == "" and s.usage.completion_tokens == 1
