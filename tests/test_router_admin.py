"""Who may manage the router's workers, SGLang's admin route names, and what the router does
when a worker fails a request it predicted as cached there (the tree forgets it)."""

import pytest
from router_helpers import start_fakes, start_router
from starlette.requests import Request

from radixray.router.admin import admin_refusal
from radixray.router.config import RouterConfig
from radixray.router.fake_worker import FakeWorker, serve_in_thread


def start(servers, n_workers=2, **config_kw):
    fakes, urls = start_fakes(servers, n_workers)
    client, router = start_router(servers, urls, **config_kw)
    return client, router, fakes, urls


def request_from(host: str, authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "method": "POST", "path": "/workers", "headers": headers,
                    "client": (host, 5555), "query_string": b""})


def test_without_a_key_only_the_routers_machine_manages_workers():
    assert admin_refusal(request_from("127.0.0.1"), None) is None
    assert admin_refusal(request_from("::1"), None) is None
    refusal = admin_refusal(request_from("10.1.2.3"), None)
    assert refusal.status_code == 403 and b"RADIXRAY_WORKER_API_KEY" in refusal.body


def test_with_a_key_every_caller_needs_it():
    assert admin_refusal(request_from("10.1.2.3", "Bearer k3y"), "k3y") is None
    for who, auth in (("127.0.0.1", None), ("10.1.2.3", "Bearer wrong"), ("10.1.2.3", "k3y")):
        assert admin_refusal(request_from(who, auth), "k3y").status_code == 401


def test_an_unauthenticated_caller_cannot_add_a_worker_to_harvest_the_key(servers):
    """An added worker would get the router's /get_server_info read with the replicas' key,
    and clients' prompts."""
    client, router, fakes, urls = start(servers, 1, worker_api_key="s3cret")
    thief = FakeWorker("thief")
    servers.append(serve_in_thread(thief.app))
    for call in (lambda: client.post("/workers", json={"url": servers[-1].url}),
                 lambda: client.post(f"/add_worker?url={servers[-1].url}"),
                 lambda: client.post(f"/remove_worker?url={urls[0]}"),
                 lambda: client.delete(f"/workers/{urls[0]}"),
                 lambda: client.get("/list_workers")):
        r = call()
        assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization"
    assert [w.url for w in router.registry.all()] == urls
    auth = {"Authorization": "Bearer s3cret"}
    assert client.post("/add_worker", params={"url": servers[-1].url},
                       headers=auth).status_code == 201


def test_sglang_admin_names(servers):
    client, router, fakes, urls = start(servers, 1)
    extra = FakeWorker("extra")
    servers.append(serve_in_thread(extra.app))
    assert client.post(f"/add_worker?url={servers[-1].url}").status_code == 201
    assert client.get("/list_workers").json() == {"urls": [urls[0], servers[-1].url]}
    assert client.post(f"/remove_worker?url={urls[0]}").json()["removed"] is True
    assert client.get("/list_workers").json() == {"urls": [servers[-1].url]}
    assert client.post("/remove_worker?url=http://nowhere:1").status_code == 404
    assert client.post("/remove_worker").status_code == 400


def test_a_failed_attempt_is_not_remembered_as_cached(servers):
    """The tree marks the chosen worker before sending; a worker that failed the request
    cached nothing, so the next request with that prefix must not be steered back to it."""
    client, router, fakes, urls = start(servers, 2)
    prefix = "a long shared system prompt for the stale tree check. " * 6
    r = client.post("/generate", json={"text": prefix + "x"})
    first = r.json()["meta_info"]["worker"]
    failing, other = (0, 1) if first == "w0" else (1, 0)
    fakes[failing].fail_status = 503
    text = prefix + "second"
    r = client.post("/generate", json={"text": text})  # predicted on the failing one: retried
    assert r.status_code == 200 and r.json()["meta_info"]["worker"] == f"w{other}"
    assert router.tree.match(text).chars_for(urls[failing]) < len(text)
    fakes[failing].fail_status = None
    r = client.post("/generate", json={"text": text + " again"})
    assert r.json()["meta_info"]["worker"] == f"w{other}"
    assert r.json()["meta_info"]["cached_tokens"] > len(prefix)


def test_abort_request_with_one_worker_unreachable_still_reports_the_abort(servers):
    client, router, fakes, urls = start(servers, 1)
    router.registry.add("http://127.0.0.1:9")  # nothing listens (discard port)
    r = client.post("/abort_request", json={"rid": "r-7"})
    assert r.status_code == 200 and r.json() == {"aborted": ["r-7"]}
    assert fakes[0].aborted == ["r-7"]


def test_deeply_nested_bodies_are_400s(servers):
    client, router, fakes, urls = start(servers, 1)
    deep = b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/generate", "/v1/completions", "/workers"):
        r = client.post(path, content=deep)
        assert r.status_code == 400, (path, r.text)
    assert fakes[0].requests == 0


def test_worker_urls_must_be_urls():
    with pytest.raises(ValueError, match="worker_urls: url: must look like http://host:port"):
        RouterConfig(worker_urls=["10.0.0.1:30001"])
