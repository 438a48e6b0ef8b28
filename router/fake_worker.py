"""A fake SGLang-compatible worker for tests and benchmarks (no model, no torch).

It answers /generate, /v1/completions and /v1/chat/completions (plain and streamed), /health,
/get_model_info, /get_server_info, /flush_cache and /abort_request in the shapes of
shared/reference/sglang-contract.md. Its "KV cache" is an exact prefix cache over characters (one
tenant of the router's own radix tree), so ``cached_tokens`` behaves like an engine's: the
router's real-hit-rate metric and the benchmarks can be exercised without a model. One character
counts as one token.

/generate takes a batch (a list of ``text``, or of ``input_ids`` lists) and ``sampling_params.n``
and answers as a replica: one result per copy, prompt-major, each copy reporting its prompt's
tokens (streamed events carry that copy's ``index``).

Knobs on the FakeWorker object (tests flip them while it serves): ``fail_status`` answers every
generation with that status (only the next ``fail_next`` ones, when that is set); ``delay`` waits before answering; ``chunk_delay`` paces stream
chunks; ``stream_abort`` (a finish reason such as ``{"type": "abort", "message": "engine died",
"status_code": 503}``) ends every stream after its first token in-band, as a replica whose
request was aborted: native answers finish with that reason, /v1 streams send the replica's
error event; ``health_status`` is what /health returns; ``restarting`` answers as a radixray
replica swapping in new ranks does (generation: its "replica is restarting" 503, /health: 503,
and no cache epoch, as it has no engine); ``restart()`` empties the cache as a restarted
engine's, under a new engine id (every answer carries the cache epoch header
``<engine>.<flushes>``, as a replica's; a flush counts up ``<flushes>``). A client that
disconnects during ``delay`` is counted in ``cancelled_requests``, the way an engine aborts such
a request.

``serve_in_thread(app)`` runs any ASGI app with uvicorn on 127.0.0.1 in a daemon thread;
``python -m radixray.router.fake_worker --port 0`` runs one in its own process and prints
``PORT <n>`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .config import CACHE_EPOCH_HEADER, RESTARTING_HEADER
from .request import request_text
from .tree import ApproxRadixTree


class FakeWorker:
    def __init__(self, name: str = "fake", cache_chars: int = 1 << 20, output_len: int = 8,
                 delay: float = 0.0, chunk_delay: float = 0.0, api_key: str | None = None):
        self.name = name
        self.cache = ApproxRadixTree(cache_chars)
        self.output_len = output_len
        self.delay = delay
        self.chunk_delay = chunk_delay
        self.api_key = api_key  # required by /get_server_info and /flush_cache when set
        self.fail_status: int | None = None
        self.fail_next: int | None = None  # with fail_status: fail only this many more
        self.stream_abort: dict | None = None
        self.linger = 0.0  # seconds a stream stays open after its [DONE] (a slow close)
        self.health_status = 200
        self.restarting = False
        self.requests = 0  # generation requests received
        self.cancelled_streams = 0  # streams whose client went away before the end
        self.cancelled_requests = 0  # requests whose client went away during ``delay``
        self.aborted: list[str] = []  # rids passed to /abort_request
        self.engine = 0  # counts restarts: the engine part of the cache epoch
        self.flushes = 0
        self.app = self._build()

    @property
    def epoch(self) -> str:
        return f"{self.name}-{self.engine}.{self.flushes}"

    def restart(self) -> None:
        """What a replica restart does to the cache: empty, under a new engine's epoch."""
        self.cache.clear()
        self.engine += 1
        self.flushes = 0

    def flush(self) -> None:
        self.cache.clear()
        self.flushes += 1

    @staticmethod
    def restarting_answer(path: str) -> JSONResponse:
        """A replica's answer to a generation request while it restarts (cluster/replica.py
        RestartGate), in its error shape for ``path``."""
        if path.startswith("/v1/"):
            body = {"object": "error", "message": "replica is restarting",
                    "type": "ServiceUnavailableError", "param": None, "code": 503}
        else:
            body = {"error": {"message": "replica is restarting", "code": 503, "param": None}}
        return JSONResponse(body, status_code=503, headers={RESTARTING_HEADER: "1"})

    # The answer is deterministic in the prompt, so a direct and a routed request match byte
    # for byte (no timestamps or random ids in it).
    def _cached(self, text: str) -> int:
        """Characters of ``text`` already cached (all but the last, like SGLang), then cache it."""
        hit = self.cache.match(text).chars_for("kv")
        self.cache.insert(text, "kv")
        return min(hit, max(len(text) - 1, 0))

    def _output(self, text: str, copy: int = 0) -> str:
        """The answer (copy ``copy`` of n starts one letter further on)."""
        return "".join(chr(97 + (len(text) + copy + i) % 26) for i in range(self.output_len))

    async def _generation(self, request: Request):
        """(the request's body, None), or (None, the answer) when it is not to be served."""
        self.requests += 1
        raw = await request.body()
        if self.restarting:
            return None, self.restarting_answer(request.url.path)
        if self.delay and await self._client_left_within(request, self.delay):
            self.cancelled_requests += 1  # an engine would abort the request here
            return None, Response(status_code=499)
        if self.fail_status is not None and self.fail_next != 0:
            if self.fail_next is not None:
                self.fail_next -= 1
            return None, JSONResponse({"error": {"message": f"{self.name} failing on purpose"}},
                                      status_code=self.fail_status)
        return json.loads(raw), None

    @staticmethod
    def _native_prompts(body: dict) -> tuple[list[str], bool]:
        """Each prompt's text (token ids one character each), and whether it was a batch."""
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return [request_text({"text": t}) for t in text], True
        if text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
            return [request_text({"input_ids": i}) for i in ids], True
        return [request_text(body)], False

    @staticmethod
    async def _client_left_within(request: Request, seconds: float) -> bool:
        """Wait ``seconds``; True as soon as the client disconnects (the body already read)."""

        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        try:
            await asyncio.wait_for(gone(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def generate(self, request: Request):
        body, error = await self._generation(request)
        if error is not None:
            return error
        texts, batch = self._native_prompts(body)
        params = body.get("sampling_params")
        n = (params.get("n") or 1) if isinstance(params, dict) else 1
        copies = []  # (prompt, cached, output) per copy, prompt-major; copies share the prompt
        for text in texts:
            cached = self._cached(text)
            copies += [(text, cached, self._output(text, copy)) for copy in range(n)]
        multi = batch or n > 1

        def result(copy, index, n_out, done):
            text, cached, out = copy
            finish = {"type": "length", "length": n_out} if done else None
            if done and self.stream_abort is not None and body.get("stream"):
                finish = self.stream_abort
            meta = {"id": f"{self.name}-{len(text)}", "prompt_tokens": len(text),
                    "completion_tokens": n_out, "cached_tokens": cached,
                    "finish_reason": finish, "e2e_latency": 0.0, "worker": self.name}
            # ids as a tokenizer's: not the text's own code points
            obj = {"text": out[:n_out], "output_ids": [1000 + ord(c) for c in out[:n_out]],
                   "meta_info": meta}
            return dict(obj, index=index) if multi and body.get("stream") else obj

        if body.get("stream"):
            events = []
            for index, copy in enumerate(copies):
                length = 1 if self.stream_abort is not None else len(copy[2])
                events += [result(copy, index, i + 1, i + 1 == length) for i in range(length)]
            return self._stream(events)
        results = [result(copy, i, len(copy[2]), True) for i, copy in enumerate(copies)]
        return JSONResponse(results if multi else results[0])

    async def openai(self, request: Request):
        body, error = await self._generation(request)
        if error is not None:
            return error
        text = request_text(body)
        n = body.get("n") or 1
        cached, outs = self._cached(text), [self._output(text, copy) for copy in range(n)]
        out = outs[0]
        chat = request.url.path.endswith("/chat/completions")
        usage = {"prompt_tokens": len(text), "completion_tokens": n * len(out),
                 "total_tokens": len(text) + n * len(out),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        base = {"id": f"{self.name}-{len(text)}", "model": "fake", "created": 0,
                "object": "chat.completion" if chat else "text_completion"}

        def choice(piece, done, delta, index=0):
            c = {"index": index, "finish_reason": "length" if done else None}
            if chat:
                c["delta" if delta else "message"] = {"role": "assistant", "content": piece}
            else:
                c["text"] = piece
            return c

        if body.get("stream"):
            events = [dict(base, choices=[choice(o[i], i + 1 == len(o), True, k)], usage=None)
                      for i in range(len(out)) for k, o in enumerate(outs)]
            if self.stream_abort is not None:  # the replica's in-band error (openai_serving)
                status = self.stream_abort.get("status_code", 500)
                message = f"request aborted: {self.stream_abort.get('message')}"
                events = events[:1] + [{"error": {"message": message, "code": status,
                                                  "type": "ServiceUnavailableError"}}]
            elif (body.get("stream_options") or {}).get("include_usage"):
                events.append(dict(base, choices=[], usage=usage))
            return self._stream(events)
        return JSONResponse(dict(base, choices=[choice(o, True, False, k)
                                                for k, o in enumerate(outs)], usage=usage))

    def _stream(self, events):
        async def gen():
            try:
                for event in events:
                    if self.chunk_delay:
                        await asyncio.sleep(self.chunk_delay)
                    yield f"data: {json.dumps(event)}\n\n".encode()
                yield b"data: [DONE]\n\n"
                if self.linger:
                    await asyncio.sleep(self.linger)
            except asyncio.CancelledError:
                self.cancelled_streams += 1
                raise

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def health(self, request: Request):
        if self.restarting:
            return PlainTextResponse("engine not ready or not making progress", status_code=503)
        return PlainTextResponse("ok" if self.health_status == 200 else "unhealthy",
                                 status_code=self.health_status)

    async def model_info(self, request: Request):
        return JSONResponse({"model_path": "fake/model", "tokenizer_path": "fake/model",
                             "is_generation": True, "worker": self.name})

    async def server_info(self, request: Request):
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "Missing or invalid API key"}},
                                status_code=401)
        return JSONResponse({"max_total_num_tokens": self.cache.max_chars, "version": "fake",
                             "worker": self.name})

    def _authorized(self, request: Request) -> bool:
        return not self.api_key or \
            request.headers.get("authorization") == f"Bearer {self.api_key}"

    async def flush_cache(self, request: Request):
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "Missing or invalid API key"}},
                                status_code=401)
        self.flush()
        return PlainTextResponse("Cache flushed.\n")

    async def abort_request(self, request: Request):
        try:
            rid = json.loads(await request.body())["rid"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": {"message": "rid: give a request id"}}, status_code=400)
        self.aborted.append(rid)
        return JSONResponse({"aborted": [rid]})

    def _build(self):
        app = Starlette(routes=[
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.openai, methods=["POST"]),
            Route("/v1/chat/completions", self.openai, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
        ])

        async def with_epoch(scope, receive, send):
            async def send_epoch(message):
                if message["type"] == "http.response.start" and not self.restarting:
                    epoch = (CACHE_EPOCH_HEADER.encode(), self.epoch.encode())
                    message = {**message, "headers": [*message.get("headers", []), epoch]}
                await send(message)

            await app(scope, receive, send_epoch if scope["type"] == "http" else send)

        return with_epoch


def _tcp_socket() -> socket.socket:
    # proto must be IPPROTO_TCP (not 0): asyncio only sets TCP_NODELAY on such sockets, and
    # without it every response waits ~40 ms for a delayed ACK (Nagle).
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app, port: int = 0):
        import uvicorn

        self.sock = _tcp_socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="auto",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.stop_nowait()
        self.join()

    def stop_nowait(self) -> None:
        """Ask the server to exit (stopping several at once is faster than one by one)."""
        self.server.should_exit = True

    def join(self) -> None:
        self.thread.join(timeout=5)
        self.sock.close()


def serve_in_thread(app, port: int = 0) -> ServerThread:
    return ServerThread(app, port).start()


def main(argv=None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="fake SGLang-compatible worker")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    parser.add_argument("--output-len", type=int, default=8)
    args = parser.parse_args(argv)
    worker = FakeWorker(args.name, output_len=args.output_len, delay=args.delay,
                        chunk_delay=args.chunk_delay)
    sock = _tcp_socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)  # connections wait in the backlog until uvicorn serves
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    sys.stdout.flush()
    server = uvicorn.Server(uvicorn.Config(worker.app, log_level="warning", access_log=False))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
