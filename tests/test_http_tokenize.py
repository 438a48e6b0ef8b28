"""/tokenize and /detokenize (SGLang's, also under /v1/): the ids the server itself uses for
/generate, the count against the context length, clear 400s; and the router passes them on."""

from __future__ import annotations

import pytest

from http_helpers import MODEL_NAME, client_fixture, serving_fixtures
from router_helpers import start_router

engine, server = serving_fixtures()


client = client_fixture()


def test_tokenize_gives_the_ids_generate_uses(client, server):
    text = "def main():\n    return 'héllo'"
    r = client.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == server.tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    info = client.get("/get_model_info").json()
    assert body["max_model_len"] == info["max_context_len"]
    gen = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert gen.json()["meta_info"]["prompt_tokens"] == body["count"]


def test_tokenize_list_and_special_tokens(client, server):
    tok = server.tokenizer
    r = client.post("/v1/tokenize", json={"model": MODEL_NAME, "prompt": ["a b", "", "import os"],
                                          "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [tok.encode(t, add_special_tokens=False)
                              for t in ("a b", "", "import os")]
    assert body["count"] == [len(t) for t in body["tokens"]]


def test_detokenize_round_trip(client, server):
    tok = server.tokenizer
    ids = tok.encode("for i in range(10): print(i)  # ünïcode")
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": tok.decode(ids, skip_special_tokens=True)}
    special = tok.eos_token_id
    r = client.post("/v1/detokenize", json={"tokens": [ids[:3] + [special], ids[3:]],
                                            "skip_special_tokens": False})
    assert r.json()["text"] == [tok.decode(ids[:3] + [special], skip_special_tokens=False),
                                tok.decode(ids[3:], skip_special_tokens=False)]
    kept = r.json()["text"][0]
    dropped = client.post("/detokenize", json={"tokens": ids[:3] + [special]}).json()["text"]
    assert tok.eos_token in kept and tok.eos_token not in dropped


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [[1], [10 ** 9]]}, "tokens[1]"),
    ("/v1/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),  # strict: true is not token 1
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
])
def test_bad_input_is_a_400_naming_the_field(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["message"] if path.startswith("/v1/") else r.json()["error"]["message"]
    assert message.startswith(field), message


@pytest.mark.parametrize("path, prompt, field", [
    ("/tokenize", "a\ud800b", "prompt"), ("/v1/tokenize", ["ok", "\udfff"], "prompt[1]")])
def test_a_lone_surrogate_is_a_400_not_a_500(client, path, prompt, field):
    """It was the tokenizer's TypeError as a 500 (which the router retried on every replica)."""
    import json

    r = client.post(path, headers={"content-type": "application/json"},
                    content=json.dumps({"prompt": prompt}))
    assert r.status_code == 400, r.text
    message = r.json()["message"] if path.startswith("/v1/") else r.json()["error"]["message"]
    assert message.startswith(f"{field}: not valid Unicode text"), message


def test_unknown_model_is_404(client):
    r = client.post("/v1/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["code"] == "model_not_found"


def test_router_passes_them_on(servers, server):
    client, _ = start_router(servers, [server.url])
    with client:
        r = client.post("/tokenize", json={"prompt": "hello world"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == server.tokenizer.encode("hello world")
        r = client.post("/v1/detokenize", json={"tokens": r.json()["tokens"]})
        assert r.json()["text"] == "hello world"
