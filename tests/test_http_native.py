"""SGLang's native API against a real server over the in-process engine: the /generate contract
field by field (including the logprob layout the frontend's ``select`` depends on), streaming,
and the operational endpoints. Every test ends with the scheduler idle and its memory
invariant holding."""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from http_helpers import (MODEL_NAME, client_fixture, post_stream, serving_fixtures, wait_idle,
                          wait_scheduled)
from radixray.router.config import CACHE_EPOCH_HEADER

GREEDY = {"temperature": 0, "max_new_tokens": 12}


engine, server = serving_fixtures()


client = client_fixture()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def hf_token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1, from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_generate_response_fields(client, server):
    tok = server.tokenizer
    r = client.post("/generate", json={"text": "def main():", "sampling_params": GREEDY})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    prompt_ids = tok.encode("def main():")
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert meta["completion_tokens"] == len(body["output_ids"]) > 0
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["e2e_latency"] > 0
    assert 0 <= meta["cached_tokens"] < len(prompt_ids)
    reason = meta["finish_reason"]
    if reason["type"] == "length":
        assert reason == {"type": "length", "length": 12} and len(body["output_ids"]) == 12
    else:
        assert reason["type"] == "stop" and reason["matched"] == body["output_ids"][-1]
    assert body["text"] == tok.decode(body["output_ids"], skip_special_tokens=True)
    assert "input_token_logprobs" not in meta  # only with return_logprob

    # Same prompt again: served from the radix cache (all but the last token), same output
    again = client.post("/generate", json={"text": "def main():", "sampling_params": GREEDY,
                                           "rid": "my-request"}).json()
    assert again["meta_info"]["cached_tokens"] == len(prompt_ids) - 1
    assert again["meta_info"]["id"] == "my-request"
    assert again["output_ids"] == body["output_ids"]


def test_input_ids_batch_and_null_sampling_values(client, server):
    tok = server.tokenizer
    ids = [tok.encode("import os"), tok.encode("class Foo:")]
    nulls = {"max_new_tokens": 5, "temperature": 0, "stop": [], "stop_token_ids": None,
             "top_k": None, "min_p": None, "regex": None, "json_schema": None, "ebnf": None,
             "n": None, "ignore_eos": None, "skip_special_tokens": None, "stop_regex": [],
             "spaces_between_special_tokens": None, "frequency_penalty": None}
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": nulls})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    for ids_i, o in zip(ids, out):
        assert o["meta_info"]["prompt_tokens"] == len(ids_i)
        single = client.post("/generate", json={"input_ids": ids_i, "sampling_params":
                                                {"max_new_tokens": 5, "temperature": 0}}).json()
        assert single["output_ids"] == o["output_ids"]  # batch answers match single answers
    # one sampling_params per prompt
    per = client.post("/generate", json={"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}]}).json()
    assert [o["meta_info"]["completion_tokens"] for o in per] == [2, 4]
    # an empty stop string is an empty value too: it must not end the output at once
    empty_stop = client.post("/generate", json={"text": "a", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "stop": ["", "\x00"]}})
    assert empty_stop.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_select_logprob_layout(client, server, hf_model):
    """The exact requests SGLang's ``select`` sends, and the layout it reads back."""
    tok = server.tokenizer
    prompt = "def add(a, b):\n    return"
    first = client.post("/generate", json={"text": prompt, "sampling_params":
                                           {"max_new_tokens": 0, "temperature": 0}}).json()
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert prompt_tokens == len(tok.encode(prompt))
    assert first["output_ids"] == [] and first["text"] == ""
    assert first["meta_info"]["completion_tokens"] == 0
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}

    choices = [" a + b", " a - b", " None"]
    start = max(prompt_tokens - 2, 0)
    r = client.post("/generate", json={
        "text": [prompt + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start})
    assert r.status_code == 200, r.text
    for choice, res in zip(choices, r.json()):
        ids = tok.encode(prompt + choice)
        meta = res["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(ids) - start
        assert entries[0][0] is None
        assert all(isinstance(e[0], float) for e in entries[1:])
        assert [e[1] for e in entries] == ids[start:]
        assert [e[2] for e in entries] == [tok.decode([t]) for t in ids[start:]]
        expected = hf_token_logprobs(hf_model, ids)[start:]
        assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=2e-3)
        assert meta["output_token_logprobs"] == []
        assert res["output_ids"] == []
        # the shared prompt was cached by the first request, up to logprob_start_len
        assert 0 < meta["cached_tokens"] <= start


def test_output_logprobs_and_top_logprobs(client, server, hf_model):
    tok = server.tokenizer
    ids = tok.encode("for i in range(")
    res = client.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                              "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}).json()
    meta = res["meta_info"]
    out = meta["output_token_logprobs"]
    assert [e[1] for e in out] == res["output_ids"] and len(out) == 6
    assert all(e[2] is None for e in out)  # no text unless return_text_in_logprobs
    full = ids + res["output_ids"]
    expected = hf_token_logprobs(hf_model, full)
    assert [e[0] for e in out] == pytest.approx(expected[len(ids) - 1:], abs=2e-3)
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx(
        expected[:len(ids) - 1], abs=2e-3)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 6
    for chosen, top in zip(out, tops):
        assert len(top) == 3
        assert top[0][1] == chosen[1]  # greedy: the chosen token is the most likely
        assert top[0][0] >= top[1][0] >= top[2][0]
    # Without logprob_start_len: one input entry, the last prompt token, null
    res = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 1}}).json()
    assert res["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]


def test_stream_is_cumulative_and_matches_non_streamed(client):
    for prompt, params in [("def main():", {"max_new_tokens": 24}),
                           ("import sys\n", {"max_new_tokens": 24, "stop": ["\n"]}),
                           ("x = [", {"max_new_tokens": 30, "ignore_eos": True})]:
        body = {"text": prompt, "sampling_params": {"temperature": 0, **params}}
        full = client.post("/generate", json=body).json()
        events = post_stream(client, "/generate", {**body, "stream": True})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        texts = [c["text"] for c in chunks]
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a)  # cumulative
        assert texts[-1] == full["text"]
        assert chunks[-1]["output_ids"] == full["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        if "stop" in params and full["meta_info"]["finish_reason"]["type"] == "stop":
            assert "\n" not in full["text"]


def test_stop_regex_ends_the_output_where_it_first_matches(client):
    body = {"text": "x = [", "sampling_params": {"temperature": 0, "max_new_tokens": 30,
                                                 "ignore_eos": True}}
    free = client.post("/generate", json=body).json()
    text = free["text"]
    # a pattern that first matches inside the output: a character from its second half
    # followed by any other; greedy decoding gives the same tokens up to the stop
    pattern, first = next((p, m.start()) for p in (re.escape(c) + "." for c in text[15:])
                          if (m := re.search(p, text)) is not None and m.start() > 0)
    body["sampling_params"]["stop_regex"] = pattern
    cut = client.post("/generate", json=body).json()
    assert cut["text"] == text[:first]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert len(cut["output_ids"]) < len(free["output_ids"])
    events = post_stream(client, "/generate", {**body, "stream": True})
    assert events[-2]["text"] == cut["text"]
    assert events[-2]["meta_info"]["finish_reason"] == cut["meta_info"]["finish_reason"]


def test_parallel_samples_share_the_prompt(client, server, engine):
    tok = server.tokenizer
    prompt = "def parse_args(argv):\n    parser ="
    n_prompt = len(tok.encode(prompt))
    computed = engine.call_sync(lambda s: s.stats.prefill_tokens)
    body = {"text": prompt, "sampling_params": {"n": 3, "max_new_tokens": 8,
                                                "temperature": 1.0, "ignore_eos": True}}
    r = client.post("/generate", json=body).json()
    assert isinstance(r, list) and len(r) == 3
    hit = r[0]["meta_info"]["cached_tokens"]  # the prompt's own: at most a common opening
    assert hit < n_prompt - 1  # not the hit its warm-up gave each copy
    # the prompt's KV was computed once (a warm-up), then each copy recomputes its last token
    assert engine.call_sync(lambda s: s.stats.prefill_tokens) - computed == n_prompt - hit + 3
    for res in r:
        assert res["meta_info"]["cached_tokens"] == hit
        assert res["meta_info"]["completion_tokens"] == 8
    assert len({tuple(res["output_ids"]) for res in r}) > 1  # sampled copies differ
    again = client.post("/generate", json=body).json()
    assert [res["meta_info"]["cached_tokens"] for res in again] == [n_prompt - 1] * 3


def test_cache_salt_and_extra_key_keep_cached_prefixes_apart(client):
    """cache_salt was silently ignored on /generate: salted tenants shared their prefixes."""
    def cached(**keys) -> int:
        body = {"text": "class Salted(object):", "sampling_params": {"max_new_tokens": 1},
                **keys}
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="b") == 0
    assert cached(extra_key="a") == 0
    assert cached(extra_key="k", cache_salt="a") == 0
    assert cached(extra_key='[null, "a"]') == 0  # no extra_key passes for a salt
    assert cached(cache_salt="a") > 0


def test_operational_endpoints(client, server, engine, tiny_llama_path):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"] == tiny_llama_path and info["is_generation"] is True
        assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["max_total_num_tokens"] == 8192 and info["schedule_policy"] == "fcfs"
        assert info["version"] and info["served_model_name"] == MODEL_NAME
    client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1}})
    wait_idle(engine)
    epoch = client.get("/health").headers[CACHE_EPOCH_HEADER]
    assert client.get("/v1/models").headers[CACHE_EPOCH_HEADER] == epoch  # on every answer
    r = client.post("/flush_cache")
    assert r.status_code == 200
    assert r.headers[CACHE_EPOCH_HEADER] != epoch  # the router learns the cache is empty
    assert engine.call_sync(lambda s: s.cache.tree.total_size()) == 0
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert 'radixray:num_requests_total{model_name="tiny",replica="0"}' in metrics.text
    assert "radixray:time_to_first_token_seconds_bucket" in metrics.text
    count = [line for line in metrics.text.splitlines()
             if line.startswith("radixray:e2e_request_latency_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


def test_abort_request_ends_a_running_generation(client, server, engine):
    import threading

    result = {}

    def long_request():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            result["r"] = c.post("/generate", json={"text": "x", "rid": "to-abort",
                                                     "sampling_params": {"max_new_tokens": 1500,
                                                                         "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    wait_scheduled(engine, "to-abort")
    assert client.post("/abort_request", json={"rid": "to-abort"}).json() == {
        "aborted": ["to-abort"]}
    t.join(30)
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 1500


def test_a_refused_duplicate_rid_leaves_the_running_request_alone(engine):
    """The scheduler refuses a second request with a live rid; the engine used to follow the
    refusal with an abort of that rid, which killed the first request."""
    import asyncio

    from radixray.cluster.engine_protocol import GenerateRequest
    from radixray.worker.sampling_params import SamplingParams

    def request(n):
        return GenerateRequest("dup-rid", [5, 6, 7], SamplingParams(max_new_tokens=n,
                                                                    ignore_eos=True))

    async def main():
        first = engine.generate(request(60))
        await first.__anext__()  # it is running
        with pytest.raises(ValueError, match="already in use"):
            async for _ in engine.generate(request(4)):
                pass
        outs = [out async for out in first]
        return outs[-1].finish_reason

    assert asyncio.run(main())["type"] == "length"
    wait_idle(engine)
    engine.check_invariant()


def test_sglang_fields_radixray_does_not_implement(client):
    """Null values of SGLang's fields are accepted (clients send every field); a value radixray
    cannot honour is a 400 naming it, never silently dropped; logprob_start_len is only
    checked when logprobs are asked for (SGLang ignores it otherwise)."""
    ok = client.post("/generate", json={
        "text": "abc", "logprob_start_len": 50,
        "sampling_params": {"max_new_tokens": 1, "custom_params": None}})
    assert ok.status_code == 200, ok.text
    for body, field in (({"sampling_params": {"custom_params": {"k": 1}}}, "custom_params"),
                        ({"token_ids_logprob": [1, 2]}, "token_ids_logprob")):
        r = client.post("/generate", json={"text": "abc", **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text



def _frozen_engine(engine):
    """Hold the engine thread between steps until the returned event is set: what is sent
    meanwhile (submissions, aborts) queues up in order."""
    import threading

    hold, held = threading.Event(), threading.Event()
    threading.Thread(target=engine.call_sync, daemon=True,
                     args=(lambda s: held.set() or hold.wait(30),)).start()
    assert held.wait(10)
    return hold


def _post_in_thread(server, body: dict) -> dict:
    import threading

    result = {}

    def post():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            result["r"] = c.post("/generate", json=body)

    result["thread"] = threading.Thread(target=post)
    result["thread"].start()
    return result


def _wait_live(server_ctx, rid: str) -> None:
    import time

    deadline = time.monotonic() + 10
    while rid not in server_ctx.live:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_abort_while_n_copies_wait_for_their_warm_up_ends_them_all(client, server, engine):
    """n > 1 copies are submitted once their prompt's warm-up prefill is done; an abort that
    came before was lost (the engine did not know the copies yet) and all of them ran."""
    hold = _frozen_engine(engine)
    sampling = {"max_new_tokens": 30, "ignore_eos": True, "n": 3}
    pending = _post_in_thread(server, {"text": "warm " * 40, "rid": "n-abort",
                                       "sampling_params": sampling})
    _wait_live(server.app.state.ctx, "n-abort")
    aborted = client.post("/abort_request", json={"rid": "n-abort"}).json()["aborted"]
    hold.set()
    pending["thread"].join(30)
    assert aborted == ["n-abort-0", "n-abort-1", "n-abort-2"]
    outs = pending["r"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
    assert all(o["meta_info"]["completion_tokens"] == 0 for o in outs)


def test_a_client_rid_cannot_collide_with_a_warm_up(client, server, engine):
    """The warm-up's rid was ``<rid>-prefill``: a client request with that rid made the n > 1
    request a 500 and, through the refusal's abort, killed the client's request. Both are
    queued while the engine is held, so they run side by side from the same step."""
    hold = _frozen_engine(engine)
    first = _post_in_thread(server, {"text": "x", "rid": "clash-prefill", "sampling_params":
                                     {"max_new_tokens": 1500, "ignore_eos": True}})
    _wait_live(server.app.state.ctx, "clash-prefill")
    second = _post_in_thread(server, {"text": "y " * 20, "rid": "clash",
                                      "sampling_params": {"max_new_tokens": 4, "n": 2}})
    _wait_live(server.app.state.ctx, "clash")
    hold.set()
    second["thread"].join(30)
    r = second["r"]
    assert r.status_code == 200 and len(r.json()) == 2, r.text
    assert engine.call_sync(lambda s: "clash-prefill" in s.live)  # still running
    client.post("/abort_request", json={"rid": "clash-prefill"})
    first["thread"].join(30)
