"""Bad input, back-pressure, authentication and disconnects, against a real server over the
in-process engine. Each test ends with the scheduler idle and its memory invariant holding:
nothing a failed or abandoned request touched is leaked."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from http_helpers import MODEL_NAME, ServerThread, client_fixture, serving_fixtures, wait_idle

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


engine, server = serving_fixtures()


client = client_fixture()


TOO_LONG = [10 + i % 2000 for i in range(2090)]  # the tiny model's context: 2048 tokens

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}]}
COMPLETION = {"model": MODEL_NAME, "prompt": "a"}

# (path, body, status, fragment the message must contain[, param])
BAD_INPUTS = [
    ("/generate", b"{not json", 400, "malformed JSON"),
    ("/generate", [1, 2], 400, "body: must be a JSON object"),
    ("/generate", {"text": 5}, 400, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "exactly one of text and input_ids"),
    ("/generate", {}, 400, "exactly one of text and input_ids"),
    ("/generate", {"text": []}, 400, "text: the prompt is empty"),
    ("/generate", {"input_ids": []}, 400, "input_ids: the prompt is empty"),
    ("/generate", {"input_ids": [1, 99999]}, 400, "input_ids: token ids must be in [0, 2048)"),
    ("/generate", {"input_ids": TOO_LONG}, 400, "input_ids: the prompt has 2090 tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "5"}}, 400,
     "max_new_tokens: must be a non-negative integer"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400,
     "max_new_tokens: must be a non-negative integer"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, 400,
     "max_new_tokens: 1000000000 new tokens"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -0.5}}, 400,
     "temperature: must be a finite number >= 0"),
    # Values the float32 sampler turns into NaN logits (which then beat a grammar's mask):
    # Python's json (the server's parser) reads Infinity and NaN.
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": Infinity}}', 400,
     "temperature: must be a finite number >= 0"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": 1e300, "regex": "[a-z]+"}},
     400, "temperature: must be a finite number >= 0"),
    ("/generate", {"text": "a", "sampling_params": {"repetition_penalty": 1e-300}}, 400,
     "repetition_penalty: must be in [1e-06, 2]"),
    ("/generate", b'{"text": "a", "sampling_params": {"logit_bias": {"5": Infinity}}}', 400,
     "logit_bias: values must be numbers in [-100, 100]"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "logit_bias": {"5": NaN}}', 400,
     "logit_bias: values must be numbers in [-100, 100]"),
    ("/generate", {"text": "a", "sampling_params": {"stop_regex": 5}}, 400, "stop_regex"),
    ("/generate", {"text": "a", "sampling_params": {"stop_regex": "a(b"}}, 400,
     "stop_regex: 'a(b' is not a valid regular expression"),
    ("/generate", {"text": "a", "sampling_params": {"stop_regex": ["\\d+", "x*"]}}, 400,
     "stop_regex: 'x*' matches the empty string"),
    # JSON can escape a lone UTF-16 surrogate; the tokenizer cannot encode it (was a 500)
    ("/generate", b'{"text": ["ok", "a\\ud800"]}', 400, "text: not valid Unicode text"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\udfff"}', 400,
     "prompt: not valid Unicode text"),
    ("/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "messages[0].content: not valid Unicode text"),
    # a stop string the scheduler could not encode stopped the engine (503 for everyone)
    ("/generate", b'{"text": "a", "sampling_params": {"stop": "\\ud800"}}', 400,
     "stop: not valid Unicode text"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "stop": ["x", "\\udc80"]}', 400,
     "stop: not valid Unicode text"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p: must be in (0, 1]"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "a+", "json_schema": "{}"}}, 400,
     "at most one of regex, json_schema, ebnf and structural_tag"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{bad"}}, 400,
     "json_schema: not valid JSON"),
    ("/generate", {"text": "a", "sampling_params": {"bogus": 1}}, 400,
     "sampling_params.bogus: unknown sampling parameter"),
    ("/generate", {"text": "a", "sampling_params": {"ignore_eos": "yes"}}, 400, "ignore_eos"),
    # both were 500s: the key went into a message JSON could not encode, the int overflowed
    ("/generate", b'{"text": "a", "sampling_params": {"\\ud800": 1}}', 400,
     "sampling_params.'\\ud800': unknown sampling parameter"),
    ("/generate", b'{"text": "a", "sampling_params": {"logit_bias": {"1": 1' + b"0" * 400 + b'}}}',
     400, "logit_bias: must map token ids to numbers"),
    ("/generate", {"text": "a", "stream": "yes"}, 400, "stream"),
    ("/generate", {"text": "abc", "return_logprob": True, "logprob_start_len": 50}, 400,
     "logprob_start_len"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400,
     "sampling_params: a list must have one entry per prompt"),
    ("/v1/completions", b"[", 400, "malformed JSON"),
    ("/v1/completions", {"prompt": "a"}, 400, "model: Field required"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "gpt-9"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, 400, "prompt: the prompt is empty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": -3}, 400,
     "max_tokens: must be a non-negative integer"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": 5000}, 400,
     "max_tokens: 5000 new tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": "10"}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "temperature": -1}, 400,
     "temperature: must be a finite number >= 0"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "n": 0}, 400, "n: must be"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": TOO_LONG}, 400, "prompt: the prompt has"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "regex": "a", "ebnf": "x"}, 400,
     "at most one of regex, json_schema, ebnf and structural_tag"),
    # errors name the client's fields, in the message too
    ("/v1/completions", {**COMPLETION, "min_tokens": 9, "max_tokens": 2},
     400, "min_tokens: must not exceed max_tokens", "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 9, "max_completion_tokens": 2},
     400, "min_tokens: must not exceed max_completion_tokens", "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens: 5000 new tokens", "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format: ",
     "response_format"),
    # seeds are 64-bit (the sampler would alias a wider one with a narrower one)
    ("/v1/completions", {**COMPLETION, "seed": 1 << 64}, 400, "seed: must be in", "seed"),
    ("/generate", {"text": "a", "sampling_params": {"seed": -(1 << 63) - 1}}, 400,
     "sampling_params.seed: must be in", "sampling_params.seed"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": -1}]}, 400,
     "sampling_params[1].max_new_tokens: must be", "sampling_params[1].max_new_tokens"),
    # OpenAI's roles only; no insert mode; best_of at least n, and never streamed above it
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "a"}]}, 400,
     "messages[0].role: Input should be 'system', 'developer'", "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [CHAT["messages"][0], {"role": "",
                                                                         "content": "a"}]},
     400, "messages[1].role", "messages[1].role"),
    ("/v1/completions", {**COMPLETION, "suffix": "return x"}, 400, "suffix: not supported",
     "suffix"),
    ("/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, 400,
     "best_of: must be at least n (3)", "best_of"),
    ("/v1/completions", {**COMPLETION, "best_of": 2, "stream": True}, 400,
     "best_of: cannot be combined with stream", "best_of"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": 3}]},
     400, "messages[0].content", "messages[0].content"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "a"}]},
     404, "nope"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_object"}, "json_schema": "{}"},
     400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": -1}, 400, "top_logprobs"),
]


def test_bad_inputs_then_a_good_request(client, engine):
    for path, body, status, fragment, *param in BAD_INPUTS:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()
        if path.startswith("/v1/"):
            assert err["object"] == "error" and set(err) == {"object", "message", "type",
                                                             "param", "code"}
            message = err["message"]
            if status == 404:
                assert err["code"] == "model_not_found" and err["param"] == "model"
        else:
            err = err["error"]
            message = err["message"]
        assert fragment in message, (path, body, message)
        assert not param or err["param"] == param[0], (path, body, err)
    assert engine.check_invariant() == 0
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3, "suffix": "",
                                             "n": 2, "best_of": 2, "seed": (1 << 64) - 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_unknown_routes_and_methods_answer_in_the_error_shape(client):
    for method, path, status in [("GET", "/v1/nonexistent", 404), ("POST", "/nowhere", 404),
                                 ("GET", "/v1/chat/completions", 405)]:
        r = client.request(method, path)
        assert r.status_code == status, (path, r.text)
        if path.startswith("/v1/"):
            assert r.json() == {"object": "error", "message": r.json()["message"], "param": None,
                                "type": {404: "NotFoundError", 405: "MethodNotAllowedError"}[
                                    status], "code": status}
        else:
            assert r.json() == {"error": {"message": f"Not Found: {path} is not an endpoint "
                                          "of this server", "code": 404, "param": None}}
    assert r.headers["allow"] == "POST"


def test_the_router_answers_as_the_replica_does(server):
    """The router refuses only what it cannot route, in the replica's words; everything else
    reaches the replica, whose answer passes through: the same answer on either port."""
    from radixray.router.app import Router, build_app
    from radixray.router.config import RouterConfig
    from radixray.router.fake_worker import serve_in_thread

    config = RouterConfig(worker_urls=[server.url], health_check_interval=60.0)
    router = serve_in_thread(build_app(config, Router(config)))
    requests = [("POST", "/v1/chat/completions", {**CHAT, "messages": body}) for body in
                ("hi", [{"role": "user", "content": 5}], [None], [{"role": "x", "content": "a"}])]
    requests += [("POST", "/v1/completions", {**COMPLETION, "prompt": body}) for body in
                 ([1, "a"], [-1], [True], [1 << 40], {"a": 1})]
    requests += [("POST", "/generate", body) for body in (
        {"input_ids": ["a"]}, {"text": 5}, {"text": "a", "routing_key": 5}, [1], b"{bad", b"")]
    requests += [("GET", path, None) for path in (
        "/v1/models/" + MODEL_NAME, "/v1/models/gpt-9", "/v1/nonexistent", "/v1/completions")]
    try:
        with httpx.Client(timeout=60) as c:
            for method, path, body in requests:
                raw = body if isinstance(body, bytes) else None if body is None else \
                    json.dumps(body).encode()
                answers = [c.request(method, url + path, content=raw)
                           for url in (server.url, router.url)]
                assert answers[0].status_code == answers[1].status_code, (path, body)
                assert answers[0].json() == answers[1].json(), (path, body)
                assert answers[0].status_code == (200 if path.endswith(MODEL_NAME) else
                                                  404 if method == "GET" and "models" in path
                                                  else 405 if method == "GET" and
                                                  path == "/v1/completions" else
                                                  404 if "nonexistent" in path else 400), path
    finally:
        router.stop()


def test_engine_rejection_is_a_400(server, engine):
    """What only the scheduler checks (here: a rid already live) still comes back as a 400
    naming the field, and the first request is unharmed."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate", json={"text": "x", "stream": True, "rid": "same",
                                                 "sampling_params": LONG}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            dup = c.post("/generate", json={"text": "y", "rid": "same",
                                            "sampling_params": {"max_new_tokens": 2}})
            assert dup.status_code == 400, dup.text
            assert dup.json()["error"]["message"].startswith("rid")
            assert engine.call_sync(lambda s: len(s.live)) == 1
    wait_idle(engine)
    assert engine.check_invariant() == 0


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server, engine, monkeypatch):
    """A megabyte prompt (refused: longer than the context) is validated and tokenized in a
    worker thread, so the replica's event loop keeps serving others meanwhile; a small one
    inline on the loop (uvicorn's thread here)."""
    on_loop = []
    encode = server.tokenizer.encode

    def spy(*args, **kwargs):
        on_loop.append(threading.current_thread() is server.thread)
        return encode(*args, **kwargs)

    monkeypatch.setattr(server.tokenizer, "encode", spy)
    huge = "def f(x):\n    return x\n" * 50_000
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/generate", json={"text": "ok", "sampling_params": {
            "max_new_tokens": 1}}).status_code == 200
        for path, body in [("/generate", {"text": huge}),
                           ("/v1/completions", {"model": MODEL_NAME, "prompt": huge}),
                           ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
                               {"role": "user", "content": huge}]})]:
            r = c.post(path, json=body)
            assert r.status_code == 400 and "context" in r.text, (path, r.text)
    assert on_loop == [True, False, False, False]
    wait_idle(engine)


def test_disconnect_mid_stream_frees_the_request(server, engine):
    before = engine.scheduler.stats.num_aborted
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/generate", json={"text": "x", "stream": True,
                                                 "sampling_params": LONG}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            assert engine.call_sync(lambda s: len(s.live)) == 1
        # leaving the block closes the connection mid-stream
    wait_idle(engine)
    assert engine.scheduler.stats.num_aborted == before + 1
    assert engine.scheduler.stats.generated_tokens < 10**6


def test_disconnect_while_waiting_non_streamed_frees_the_request(server, engine):
    before = engine.scheduler.stats.num_aborted
    with httpx.Client(base_url=server.url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                            "max_tokens": 1500, "ignore_eos": True, "n": 2})
    wait_idle(engine)
    assert engine.scheduler.stats.num_aborted >= before + 2


def test_queue_limit_gives_429(engine, tiny_llama_path):
    """Hold the engine thread so admitted requests cannot start; the third one is refused."""
    release = threading.Event()
    blocker = threading.Thread(target=engine.call_sync, args=(lambda s: release.wait(30),))
    blocker.start()
    results = []
    srv = ServerThread(engine, tiny_llama_path, max_queued_requests=2)
    with srv as url:
        def send():
            results.append(httpx.post(url + "/generate", json={
                "text": "q", "sampling_params": {"max_new_tokens": 2}}, timeout=60))

        senders = [threading.Thread(target=send) for _ in range(2)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 10
        while len(srv.app.state.ctx.waiting) < 2:  # both admitted, neither started
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "q",
                                                            "max_tokens": 2}, timeout=10)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "max_queued_requests=2" in refused.json()["message"]
        release.set()
        for t in senders:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        ok = httpx.post(url + "/generate", json={"text": "q", "sampling_params":
                                                 {"max_new_tokens": 2}}, timeout=60)
        assert ok.status_code == 200
    blocker.join(10)
    wait_idle(engine)


def test_api_key(engine, tiny_llama_path):
    with ServerThread(engine, tiny_llama_path, api_key="sekrit") as url:
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["object"] == "error"
            r = httpx.post(url + "/generate", json={"text": "a"}, headers=headers, timeout=30)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        for path in ("/get_model_info", "/v1/models", "/flush_cache"):
            assert httpx.get(url + path, timeout=30).status_code == 401
        for path in ("/health", "/health_generate", "/metrics"):  # probes and scrapers
            assert httpx.get(url + path, timeout=30).status_code == 200
        good = {"Authorization": "Bearer sekrit"}
        r = httpx.post(url + "/v1/completions", json=body, headers=good, timeout=30)
        assert r.status_code == 200
        assert httpx.get(url + "/get_model_info", headers=good, timeout=30).status_code == 200
    wait_idle(engine)


def test_health_is_503_when_stuck_or_not_running(engine, tiny_llama_path):
    from radixray.cluster.async_engine import InProcessEngine

    release = threading.Event()
    with ServerThread(engine, tiny_llama_path, health_check_timeout=0.5) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        blocker = threading.Thread(target=engine.call_sync, args=(lambda s: release.wait(30),))
        blocker.start()  # the engine thread makes no progress while this runs
        try:
            r = httpx.get(url + "/health_generate", timeout=10)
            assert r.status_code == 503 and "not making progress" in r.text
        finally:
            release.set()
            blocker.join(10)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    never_started = InProcessEngine(engine.scheduler, engine.server_info())
    with ServerThread(never_started, tiny_llama_path) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = httpx.post(url + "/generate", json={"text": "a"}, timeout=10)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        # streamed too: the status line waits for the first event, here the error (it was a
        # 200 with the error in-band, which no router or client library retries)
        with httpx.Client(base_url=url, timeout=10) as c:
            for path, body in [("/generate", {"text": "a"}),
                               ("/v1/completions", {"model": MODEL_NAME, "prompt": "a"}),
                               ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
                                   {"role": "user", "content": "a"}]})]:
                r = c.post(path, json={**body, "stream": True})
                assert r.status_code == 503, (path, r.text)
                body = r.json()
                assert "not running" in body.get("error", body)["message"], path
    wait_idle(engine)
