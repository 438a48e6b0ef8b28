"""What the router books for each answer: a stream a worker ended in-band with a server error is
a failure (bytes untouched), and the cache metrics count each prompt once, whether the answer
is streamed, a batch or n copies, and only for answers that were served; a stream whose books
cannot be settled still frees its admission slot."""

import json
import time

import httpx
import pytest

from radixray.router import proxy as proxy_module
from router_helpers import metric, start_fakes, start_router, wait_until

P = "radixray_router:"
ENGINE_DIED = {"type": "abort", "message": "engine died", "status_code": 503}


def real_counts(client) -> tuple[float, float]:
    return (metric(client, P + "real_cached_tokens_total"),
            metric(client, P + "real_prompt_tokens_total"))


@pytest.mark.parametrize("route,body", [
    ("/generate", {"text": "a prompt", "stream": True}),
    ("/generate", {"text": ["a prompt", "another"], "stream": True}),
    ("/v1/completions", {"prompt": "a prompt", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
def test_a_stream_the_worker_aborts_with_a_server_error_is_booked_as_failed(servers, route,
                                                                             body):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, breaker_failure_threshold=1)
    fakes[0].stream_abort = ENGINE_DIED
    direct = httpx.post(urls[0] + route, json=body, timeout=10)
    fakes[0].flush()  # the routed request sees the same cache
    routed = client.post(route, json=body)
    assert routed.status_code == 200 and routed.content == direct.content  # bytes untouched
    assert b"engine died" in routed.content
    route_label = f'route="{route}"'
    assert wait_until(lambda: metric(client, P + f'requests_total{{{route_label},status="502"}}'))
    assert metric(client, P + f'requests_total{{{route_label},status="200"}}') == 0
    assert metric(client, P + f'errors_total{{kind="stream",worker="{urls[0]}"}}') == 1
    assert metric(client, P + f'circuit_state{{worker="{urls[0]}"}}') == 1  # a breaker failure
    assert router.registry.get(urls[0]).served == 0
    assert real_counts(client) == (0, 0)


@pytest.mark.parametrize("reason", [
    {"type": "abort", "message": "aborted by request"},  # the client's /abort_request
    {"type": "abort", "message": "bad grammar", "status_code": 400},  # the client's input
])
def test_a_stream_aborted_for_the_clients_sake_is_no_failure(servers, reason):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, breaker_failure_threshold=1)
    fakes[0].stream_abort = reason
    assert client.post("/generate", json={"text": "x", "stream": True}).status_code == 200
    assert wait_until(lambda: metric(
        client, P + 'requests_total{route="/generate",status="200"}') == 1)
    assert metric(client, P + f'circuit_state{{worker="{urls[0]}"}}') == 0
    assert router.registry.get(urls[0]).served == 1


def test_a_stream_the_client_closes_after_its_last_event_is_served_not_cut(servers):
    """SGLang's frontend closes a stream once it reads [DONE]; when that beat the upstream's
    end of stream, about half of the complete streams were booked as 499s (client gone),
    their tokens and the worker's success never counted."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    fakes[0].linger = 5.0
    with client.stream("POST", "/generate", json={"text": "a prompt", "stream": True}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break  # and close, as the frontend does
    assert wait_until(lambda: metric(
        client, P + 'requests_total{route="/generate",status="200"}') == 1)
    assert metric(client, P + 'requests_total{route="/generate",status="499"}') == 0
    assert router.registry.get(urls[0]).served == 1
    assert real_counts(client)[1] > 0


@pytest.mark.parametrize("params", [{}, {"n": 3}])
def test_every_prompt_of_a_batch_counts_once_streamed_or_not(servers, params):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    prompts = ["first prompt", "second, longer prompt", "third"]  # no shared prefix
    client.post("/generate", json={"text": prompts[0]})  # cached now: the batch hits it
    base = real_counts(client)
    # what the answers say, each prompt once (every copy of a prompt reports the prompt's)
    per_prompt = (len(prompts[0]) - 1, sum(map(len, prompts)))
    for stream in (False, True):
        fakes[0].flush()
        fakes[0].cache.insert(prompts[0], "kv")
        before = real_counts(client)
        r = client.post("/generate", json={"text": prompts, "sampling_params": params,
                                           "stream": stream})
        assert r.status_code == 200
        if not stream:
            answers = r.json()
            assert len(answers) == len(prompts) * params.get("n", 1)
            assert {a["meta_info"]["prompt_tokens"] for a in answers[:params.get("n", 1)]} == \
                {len(prompts[0])}
        assert wait_until(lambda: real_counts(client) != before, 2)
        after = real_counts(client)
        assert (after[0] - before[0], after[1] - before[1]) == per_prompt, stream
    assert base[1] == len(prompts[0])


def test_an_answer_refused_by_the_worker_adds_nothing_to_the_predictions(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    fakes[0].fail_status = 400
    assert client.post("/generate", json={"text": "x" * 1000}).status_code == 400
    assert metric(client, P + "request_chars_total") == 0
    assert metric(client, P + "predicted_cache_hit_rate") == 0
    fakes[0].fail_status = None
    assert client.post("/generate", json={"text": "y" * 10}).status_code == 200
    assert metric(client, P + "request_chars_total") == 10


def test_a_stream_whose_end_cannot_be_read_still_frees_its_slot(servers, monkeypatch):
    def broken_stream_end(events, copies):
        raise ValueError("a worker's odd last event")

    monkeypatch.setattr(proxy_module, "stream_end", broken_stream_end)
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, max_concurrent_requests=1, queue_size=0)
    assert client.post("/generate", json={"text": "x", "stream": True}).status_code == 200
    assert wait_until(lambda: metric(
        client, P + 'requests_total{route="/generate",status="200"}') == 1)
    assert client.post("/generate", json={"text": "y"}).status_code == 200  # not a 429


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate", "/v1/completions"])
def test_a_conversations_next_turn_goes_where_its_answer_is_cached(servers, route, stream):
    """The tree learned only the prompts: a second turn (first prompt, its answer, a new
    message) matched under the cache threshold, and the miss went to the other replica, the
    one with the smaller tree, every time."""
    fakes, urls = start_fakes(servers, 2)
    client, router = start_router(servers, urls)
    first, question = "hi", "ok"

    def ask(text):
        if route == "/v1/chat/completions":
            body = {"messages": text}
        else:
            body = {"text" if route == "/generate" else "prompt": text}
        r = client.post(route, json={**body, "stream": stream})
        assert r.status_code == 200
        if not stream:
            answer = r.json()
            return answer["text"] if route == "/generate" else (
                answer["choices"][0]["message"]["content"] if "message" in
                answer["choices"][0] else answer["choices"][0]["text"])
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        if route == "/generate":
            return events[-1]["text"]
        return "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                       for e in events for c in e["choices"])

    turn = [{"role": "user", "content": first}] if route.endswith("chat/completions") else first
    answer = ask(turn)
    served = [f.requests for f in fakes]
    holder = served.index(1)
    assert wait_until(lambda: router.tree.size(urls[holder]) > len(first) + 1)
    if route.endswith("chat/completions"):
        ask(turn + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": question}])
    else:
        ask(first + answer + question)
    assert fakes[holder].requests == 2 and fakes[1 - holder].requests == 0


def test_native_streams_teach_their_own_answer_only(servers):
    """A long native stream (each event repeats the text so far) passed the kept-events cap and
    taught nothing; a streamed batch taught its first prompt followed by another's answer."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    fakes[0].output_len = 2000  # 2,000 cumulative events: ~2 MB of them
    r = client.post("/generate", json={"text": "long", "stream": True})
    answer = json.loads(r.text.split("data: ")[-2])["text"]
    assert len(answer) == 2000
    assert wait_until(lambda: router.tree.match("long" + answer).chars_for(urls[0]) ==
                      len("long" + answer))
    fakes[0].output_len = 8
    r = client.post("/generate", json={"text": ["AAAA", "BBBBBBB"], "stream": True})
    second = [json.loads(e) for e in r.text.split("data: ")[1:-1]][-1]["text"]
    time.sleep(0.3)  # the stream's books are settled after its last byte
    assert router.tree.match("AAAA" + second).chars_for(urls[0]) <= len("AAAA")


def test_an_answer_learned_after_a_flush_does_not_bring_the_worker_back(servers):
    """Answers are learned after they went out; a flush (or a restart) in between was undone:
    the tree claimed the flushed worker held the prompt and its answer."""
    from radixray.router.policies import RequestInfo

    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    worker = router.registry.get(urls[0])
    mark = router.tree.forget_count  # an answer completes here ...
    assert client.post("/flush_cache").status_code == 200  # ... the cache is flushed ...
    router.proxy._learn_answer(worker, "/generate", RequestInfo("hi there"), [" answer"], mark)
    assert router.tree.match("hi there answer").chars_for(urls[0]) == 0  # ... nothing back
    router.proxy._learn_answer(worker, "/generate", RequestInfo("hi there"), [" answer"],
                               router.tree.forget_count)
    assert router.tree.match("hi there answer").chars_for(urls[0]) == len("hi there answer")


def _answers(route: str, response: httpx.Response, stream: bool) -> list[str]:
    """Each choice's text of an answer (index order), streamed or not."""
    if not stream:
        obj = response.json()
        objs = obj if isinstance(obj, list) else [obj]
        if route == "/generate":
            return [o["text"] for o in objs]
        return [c["message"]["content"] if "message" in c else c["text"]
                for c in obj["choices"]]
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    if route == "/generate":
        last = {e.get("index"): e["text"] for e in events}
        return [last[i] for i in sorted(last)]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c.get("text") or c.get("delta", {}).get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate", "/v1/completions"])
def test_every_choice_of_an_answer_is_learned(servers, route, stream):
    """With n > 1 the tree learned the prompt only: a next turn continuing any of the choices
    (the engine cached all of them) matched only the prompt."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    if route == "/v1/chat/completions":
        body, prompt = {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "hi\n"
    elif route == "/generate":
        body, prompt = {"text": "hi", "sampling_params": {"n": 3}}, "hi"
    else:
        body, prompt = {"prompt": "hi", "n": 3}, "hi"
    answers = _answers(route, client.post(route, json={**body, "stream": stream}), stream)
    assert len(set(answers)) == 3
    for routed in (prompt + answer for answer in answers):
        assert wait_until(lambda: router.tree.match(routed).chars_for(urls[0]) == len(routed))


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_id_prompt_learns_its_output_ids(servers, stream):
    """A native ``input_ids`` prompt is routed by its ids; its answer was learned as text
    after them, which no next turn (ids again) ever matched."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    r = client.post("/generate", json={"input_ids": [104, 105], "stream": stream})
    out = json.loads(r.text.split("data: ")[-2]) if stream else r.json()
    routed = "hi" + "".join(map(chr, out["output_ids"]))
    assert wait_until(lambda: router.tree.match(routed).chars_for(urls[0]) == len(routed))


def test_a_continued_message_is_learned_without_a_joint(servers):
    """With ``continue_final_message`` the answer extends the last message: the next turn
    holds "...partial answer", not "...partial\\nanswer" as it was learned."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    r = client.post("/v1/chat/completions",
                    json={"messages": messages, "continue_final_message": True})
    routed = "hi\nSure" + r.json()["choices"][0]["message"]["content"]
    assert wait_until(lambda: router.tree.match(routed).chars_for(urls[0]) == len(routed))


@pytest.mark.parametrize("stream", [False, True])
def test_a_batchs_answers_are_not_learned_after_its_first_prompt(servers, stream):
    """For prompt ["A", "B"] the tree learned B's answer after A (the routing text)."""
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    r = client.post("/v1/completions", json={"prompt": ["first one", "second"],
                                             "stream": stream})
    assert r.status_code == 200
    time.sleep(0.3)  # the answer is learned (or not) after its last byte
    assert router.tree.match("first one" + "z").chars_for(urls[0]) <= len("first one")
    assert router.tree.size(urls[0]) == len("first one")
