"""Request bodies: --max-payload-size (413 in the route's error shape, from Content-Length before
the body is read, or while reading one without it), and large bodies parsed in a helper process
so that the router's event loop keeps serving everyone else meanwhile."""

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

from radixray.router.bodies import LARGE_BODY_BYTES, Offloader
from radixray.router.request import read_request
from router_helpers import metric, start_fakes, start_router, wait_until

P = "radixray_router:"


def test_a_body_over_the_limit_is_a_413_in_the_routes_shape(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, max_payload_size=1000)
    big = json.dumps({"text": "x" * 1000}).encode()
    r = client.post("/generate", content=big)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["param"] == "body" and "limit of 1000 bytes" in error["message"]
    r = client.post("/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["type"] == "PayloadTooLargeError"

    def chunked():  # no Content-Length: counted while read
        yield big[:600]
        yield big[600:]

    assert client.post("/generate", content=chunked()).status_code == 413
    for path in ("/tokenize", "/abort_request", "/workers"):
        assert client.post(path, content=big).status_code == 413, path
    assert fakes[0].requests == 0 and fakes[0].aborted == []
    assert metric(client, P + 'requests_total{route="/generate",status="413"}') == 2
    assert client.post("/generate", json={"text": "x" * 900}).status_code == 200  # <= 1000


def test_a_declared_length_over_the_limit_is_refused_before_the_body_comes(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls, max_payload_size=1 << 20)
    host, port = urlsplit(str(client.base_url)).hostname, urlsplit(str(client.base_url)).port
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000\r\n\r\n{\"text\": ")
        answer = sock.recv(65536)  # never sends the gigabyte: the answer must not wait for it
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_large_batch_is_routed_on_its_first_prompt_and_counted(servers):
    fakes, urls = start_fakes(servers, 1)
    client, router = start_router(servers, urls)
    prompts = [f"prompt number {i:05d} " * 4 for i in range(2000)]
    body = json.dumps({"text": prompts})
    assert len(body) > LARGE_BODY_BYTES  # request and answer both go through the helper
    r = client.post("/generate", content=body)
    assert r.status_code == 200 and len(r.json()) == len(prompts)
    assert router.tree.match(prompts[0]).chars_for(urls[0]) == len(prompts[0])
    assert wait_until(lambda: metric(client, P + "real_prompt_tokens_total") ==
                      sum(map(len, prompts)))
    r = client.post("/generate", content=body[:-1])  # malformed: 400 in the replica's words
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("body: malformed JSON (Expecting")


def test_a_large_body_is_parsed_without_stalling_the_event_loop():
    raw = json.dumps({"text": ["ab"] * 1_500_000, "sampling_params": {"n": 2}}).encode()
    start = time.perf_counter()
    json.loads(raw)
    inline = time.perf_counter() - start  # what parsing on the loop (or a thread) stalls it

    async def scenario():
        offload = Offloader()
        try:
            # start the helper first (a fresh interpreter): not what is measured here
            await offload.run(LARGE_BODY_BYTES, read_request, b'{"text": "warm"}', None, True)
            gaps = []

            async def ticker():
                while True:
                    before = time.perf_counter()
                    await asyncio.sleep(0.005)
                    gaps.append(time.perf_counter() - before)

            tick = asyncio.create_task(ticker())
            info = await offload.run(len(raw), read_request, raw, "key", True)
            tick.cancel()
            return info, max(gaps)
        finally:
            offload.close()

    info, stall = asyncio.run(scenario())
    assert (info.text, info.routing_key, info.stream) == ("ab", "key", False)
    assert info.copies == 2
    assert stall < inline / 3, (stall, inline)


def die_in_the_helper(value):
    if multiprocessing.parent_process() is not None:
        os._exit(1)  # the helper process dies under this body (as if killed for its memory)
    return value


def test_a_dead_helper_costs_no_request_and_is_replaced():
    async def scenario():
        offload = Offloader()
        try:
            assert await offload.run(LARGE_BODY_BYTES, die_in_the_helper, "in a thread") == \
                "in a thread"
            return await offload.run(LARGE_BODY_BYTES, read_request, b'{"text": "t"}', None,
                                     False)
        finally:
            offload.close()

    assert asyncio.run(scenario()).text == "t"


def gone(pid: int) -> bool:
    """No such process, or a zombie (a container's init may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_helper_leaves_with_a_router_killed_without_its_shutdown():
    # SIGKILL, or uvicorn re-raising SIGTERM after its shutdown: no exit hook of the pool runs
    code = ("import asyncio, os, signal\n"
            "from radixray.router.bodies import LARGE_BODY_BYTES, Offloader\n"
            "async def main():\n"
            "    print(await Offloader().run(LARGE_BODY_BYTES, os.getpid), flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "asyncio.run(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    helper = int(proc.stdout)
    assert wait_until(lambda: gone(helper), 5)
