"""Edges of SGLang's native API found by probing: batch rids and aborts, client-error aborts,
the default max_new_tokens at the context's end, no_stop_trim text, and rids within one body.
Every test ends with the scheduler idle and its memory invariant holding."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from http_helpers import (MODEL_NAME, ServerThread, client_fixture, make_engine,
                          serving_fixtures)
from test_http_native import _frozen_engine, _post_in_thread

engine, server = serving_fixtures()
client = client_fixture()


def test_aborting_one_prompts_rid_leaves_the_rest_of_its_batch(client, server, engine):
    """The batch was registered under its first prompt's rid: aborting that rid aborted all."""
    hold = _frozen_engine(engine)
    sampling = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
    pending = _post_in_thread(server, {"text": ["one", "two"], "rid": ["first", "second"],
                                       "sampling_params": sampling})
    ctx = server.app.state.ctx
    deadline = time.monotonic() + 10
    while not any("first" in rids for rids in ctx.live.values()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.post("/abort_request", json={"rid": "first"}).json() == {"aborted": ["first"]}
    hold.set()
    pending["thread"].join(30)
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in pending["r"].json()]
    assert reasons == ["abort", "length"]


def test_an_unknown_rid_is_not_reported_aborted(client):
    assert client.post("/abort_request", json={"rid": "no-such-request"}).json() == {
        "aborted": []}


def test_a_client_error_abort_is_a_400_not_a_200(client):
    """A grammar that allows no text ends its request with an abort carrying status 400; the
    native API answered 200 with empty text (SGLang's frontend then returned "")."""
    r = client.post("/generate", json={"text": "a", "sampling_params": {"regex": "[^\\s\\S]"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]  # named as the client's field (it said "request aborted: regex")
    assert err["message"] == "sampling_params.regex: no text satisfies the grammar"
    assert err["param"] == "sampling_params.regex"
    for stream in (False, True):
        r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a",
                                                 "regex": "[^\\s\\S]", "stream": stream})
        # streamed too: the status line waits for the first event, so it is a 400 as well
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        err = r.json()
        assert (err["param"], err["message"]) == ("regex",
                                                  "regex: no text satisfies the grammar"), r.text
    r = client.post("/generate", json={"text": "a", "stream": True,
                                       "sampling_params": {"regex": "[^\\s\\S]"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex"


def test_a_grammar_error_from_the_scheduler_names_the_clients_field():
    from radixray.cluster.api_errors import abort_error

    reason = {"type": "abort", "status_code": 400,
              "message": "json_schema: compilation timed out after 30 s"}
    err = abort_error(reason, {"json_schema": "response_format"})
    assert (err.status, err.param) == (400, "response_format")
    assert err.message == "response_format: compilation timed out after 30 s"
    for status in (429, 503):  # the server's load or state: no client error to name
        busy = {**reason, "status_code": status, "message": "json_schema: 4 grammars are ..."}
        assert abort_error(busy, {"json_schema": "response_format"}).param is None


def test_the_default_max_new_tokens_ends_at_the_context(client, engine):
    """1,950 prompt tokens + the default 128 pass the 2,048-token context: that was a 400
    naming max_new_tokens, which the client never sent. As SGLang, only a value the client
    set must fit; the default stops at the context's end."""
    ids = [5] * 1950
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 98}
    r = client.post("/generate", json={"input_ids": ids,
                                       "sampling_params": {"max_new_tokens": 128}})
    assert r.status_code == 400 and "max_new_tokens: 128 new tokens" in r.text


def test_no_stop_trim_keeps_the_whole_token_that_completed_the_stop(client, server):
    """As SGLang and the offline Engine: the text is every output token decoded; HTTP cut it at
    the end of the match, inside the last token."""
    plain = client.post("/generate", json={"text": "def fib(n):", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}).json()
    ids = plain["output_ids"]
    tokenizer = server.tokenizer
    # a stop string ending one character into the third token's text
    third = tokenizer.decode(ids[:3])
    stop = third[-3:] + tokenizer.decode(ids[:4])[len(third):][:1]
    r = client.post("/generate", json={"text": "def fib(n):", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop": stop, "no_stop_trim": True}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == tokenizer.decode(r["output_ids"])


def test_one_rid_twice_in_a_streamed_batch_is_a_400_before_the_stream(server):
    body = {"text": ["a", "b"], "rid": ["dup", "dup"], "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 400 and "'dup' appears twice" in r.text


def test_one_prompt_of_a_batch_with_n_copies_aborts_by_its_rid(client, server, engine):
    """Its copies are first-0, first-1: the prompt's own rid named nothing the engine had."""
    hold = _frozen_engine(engine)
    sampling = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0, "n": 2}
    pending = _post_in_thread(server, {"text": ["one", "two"], "rid": ["first", "second"],
                                       "sampling_params": sampling})
    ctx = server.app.state.ctx
    deadline = time.monotonic() + 10
    while "first" not in ctx.prompts:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    aborted = client.post("/abort_request", json={"rid": "first"}).json()["aborted"]
    hold.set()
    pending["thread"].join(30)
    assert aborted == ["first-0", "first-1"]
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in pending["r"].json()]
    assert reasons == ["abort", "abort", "length", "length"]
    assert not ctx.prompts  # forgotten when the request ended


def test_a_large_batch_is_checked_for_repeated_rids_in_linear_time():
    """The check compared each rid with all before it: 10,000 rids took 4.7 s on the loop."""
    from radixray.cluster.engine_protocol import GenerateRequest
    from radixray.cluster.api_errors import APIError
    from radixray.cluster.generation import ServingContext
    from radixray.worker.sampling_params import SamplingParams

    ctx = ServingContext(None, None, "m", 2048, 2048)
    reqs = [GenerateRequest(f"r{i}", [1], SamplingParams()) for i in range(50_000)]
    started = time.perf_counter()
    with pytest.raises(APIError, match="'r49999' appears twice"):
        ctx.open_session("big", reqs + reqs[-1:])
    assert time.perf_counter() - started < 2.0  # quadratic: minutes


def test_a_prompt_the_kv_cache_cannot_hold_is_a_400_naming_the_clients_field(tiny_llama_path):
    """It named input_ids whatever the client sent, and streamed it was a 200 with an in-band
    error (which the router counted as served)."""
    eng = make_engine(tiny_llama_path, max_total_tokens=64)
    try:
        with ServerThread(eng, tiny_llama_path) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            long = "import os\n" * 40  # well past 64 tokens, inside the 2048-token context
            for path, body, field in (
                    ("/generate", {"text": long, "stream": True}, "text"),
                    ("/v1/completions", {"model": MODEL_NAME, "prompt": long, "stream": True},
                     "prompt"),
                    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
                        {"role": "user", "content": long}]}, "messages")):
                r = client.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                err = r.json() if path.startswith("/v1/") else r.json()["error"]
                assert err["param"] == field and "the KV cache holds 64" in err["message"]
            r = client.post("/generate", json={"text": "short", "sampling_params": {
                "max_new_tokens": 2}})
            assert r.status_code == 200
        assert eng.check_invariant() == 0
    finally:
        eng.shutdown()


def test_a_stop_regex_that_backtracks_for_ever_ends_only_its_own_request(client):
    """It froze the replica's engine thread and event loop for good (even /health waited)."""
    slow = {"text": "def f(x):", "sampling_params": {
        "max_new_tokens": 60, "ignore_eos": True, "stop_regex": r"(.|.)+\d{6}"}}
    for stream in (False, True):
        started = time.monotonic()
        r = client.post("/generate", json={**slow, "stream": stream})
        assert time.monotonic() - started < 20
        if stream:
            assert r.status_code == 200 and "took over" in r.text and "stop_regex" in r.text
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop_regex", r.text
    r = client.post("/generate", json={"text": "def f(x):", "sampling_params": {
        "max_new_tokens": 4, "stop_regex": r"\d{6}"}})
    assert r.status_code == 200 and client.get("/health").status_code == 200


def test_abort_all_and_rid_are_typed(client):
    """{"abort_all": "false"} aborted every live request; a rid with a lone surrogate was a
    500 after the generation had run (the router then ran it again on every replica)."""
    r = client.post("/abort_request", json={"abort_all": "false"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "abort_all"
    for rid in ("a\ud800", ["ok", "b\udfff"]):
        body = {"text": ["x", "y"] if isinstance(rid, list) else "x", "rid": rid}
        r = client.post("/generate", content=json.dumps(body),  # escaped, as JSON may
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


def test_top_logprobs_num_past_the_vocab_is_a_400(client, engine):
    """It stopped the engine (topk past the vocab), and the router spread it to every replica."""
    for top_n in (3000, 2 ** 70):
        r = client.post("/generate", json={"text": "abc", "return_logprob": True,
                                           "logprob_start_len": 0, "top_logprobs_num": top_n,
                                           "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num", r.text
    r = client.post("/generate", json={"text": "abc", "return_logprob": True,
                                       "logprob_start_len": 0, "top_logprobs_num": 2048,
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200  # the whole vocabulary is allowed
    assert len(r.json()["meta_info"]["input_top_logprobs"][1]) == 2048


def test_an_empty_text_is_the_bos_token_alone(client):
    """SGLang's frontend starts a program with a gen on "" (the BOS token): it was a 400."""
    r = client.post("/generate", json={"text": "", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 1, r.text
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1, r.text
    r = client.post("/generate", json={"input_ids": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"


def test_more_sequences_than_the_queue_limit_is_a_400_not_a_429(engine, tiny_llama_path):
    """A request of n copies or prompts beyond --max-queued-requests was a 429 "retry later"
    on an idle server: no retry could ever succeed (and the router retried it)."""
    with ServerThread(engine, tiny_llama_path, max_queued_requests=2) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        small = {"max_new_tokens": 2}
        for path, body, field in (
                ("/generate", {"text": "q", "sampling_params": {**small, "n": 3}},
                 "sampling_params.n"),
                ("/generate", {"text": ["a", "b", "c"], "sampling_params": small}, "text"),
                ("/generate", {"input_ids": [[5], [6], [7]], "sampling_params": small},
                 "input_ids"),
                ("/v1/completions", {"model": MODEL_NAME, "prompt": "q", "n": 3,
                                     "max_tokens": 2}, "n"),
                ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b", "c"],
                                     "max_tokens": 2}, "prompt"),
                ("/v1/chat/completions", {"model": MODEL_NAME, "n": 3, "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "q"}]}, "n")):
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json() if path.startswith("/v1/") else r.json()["error"]
            assert err["param"] == field and "max_queued_requests (2)" in err["message"]
        r = client.post("/generate", json={"text": "q", "sampling_params": {**small, "n": 2}})
        assert r.status_code == 200 and len(r.json()) == 2
    assert engine.check_invariant() == 0


def test_an_engine_failing_before_a_streams_first_event_is_an_http_error(tiny_llama_path):
    """A stream's 200 went out before the engine was asked: an engine that failed under the
    queued request (or a replica restarting) reached the client as a 200 with an in-band error,
    which neither the router nor a client library retries."""
    eng = make_engine(tiny_llama_path)

    def broken_forward(batch):
        raise RuntimeError("device fell off the bus")

    eng.scheduler.runner.forward = broken_forward
    try:
        with ServerThread(eng, tiny_llama_path) as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}],
                "stream": True})
            assert r.status_code >= 500 and "device fell off the bus" in r.json()["message"]
            r = httpx.post(url + "/generate", json={"text": "a", "stream": True}, timeout=30)
            assert r.status_code == 503, r.text  # the engine is down by now
    finally:
        eng.shutdown()


def test_a_batch_past_the_sequence_limit_is_a_400_before_any_work(client):
    """One 8 MB body of 1M two-byte prompts grew a replica to 12.6 GB and froze it for
    minutes (aborting them scanned the queue once per prompt). At most 65,536 sequences
    (prompts x n) per request; the field that makes them is named."""
    from radixray.cluster.request_checks import MAX_SEQUENCES_PER_REQUEST as limit

    cases = [("/generate", {"text": ["a"] * (limit + 1)}, "text"),
             ("/generate", {"input_ids": [[5]] * (limit + 1)}, "input_ids"),
             ("/generate", {"text": ["a"] * 600, "sampling_params": {"n": 110}},
              "sampling_params.n"),
             ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a"] * (limit + 1)}, "prompt")]
    for path, body, field in cases:
        started = time.monotonic()
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, r.text[:300])
        error = r.json().get("error", r.json())
        assert error["param"] == field and "send the batch as several requests" in \
            error["message"], error
        assert time.monotonic() - started < 30
    assert client.post("/generate", json={"text": ["a"] * 3}).status_code == 200


def test_engine_failure_aborts_live_requests_instead_of_hanging(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        with ServerThread(eng, tiny_llama_path) as url, httpx.Client(base_url=url,
                                                                     timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL_NAME, "prompt": "x", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}) as r:
                lines = (line for line in r.iter_lines() if line)
                assert next(lines).startswith("data: {")

                def broken_forward(batch):
                    raise RuntimeError("device fell off the bus")

                eng.scheduler.runner.forward = broken_forward
                rest = list(lines)
            assert any('"error"' in line and "device fell off the bus" in line for line in rest)
            assert rest[-1] == "data: [DONE]"
            assert c.get("/health").status_code == 503
            r = c.post("/generate", json={"text": "a"})
            assert r.status_code == 503 and "engine is not running" in r.json()["error"]["message"]
    finally:
        eng.shutdown()
    assert not eng.alive and isinstance(eng.failure, RuntimeError)
