"""Forwarding a generation request: choose a worker, send, retry elsewhere on failure.

Non-streamed requests are retried on connection errors, timeouts and retryable statuses.
Streamed requests are retried the same way until the first body byte has arrived from a worker;
after that the router is committed: the bytes pass through chunk by chunk as they come (no
buffering, no re-encoding), an upstream failure becomes an in-band SSE error event, and a client
disconnect closes the upstream connection, which makes the worker abort the generation.

Each answer's cache epoch is read before its outcome is booked on the worker's breaker, so a
new engine's first answer is judged by the new engine's (reset) breaker. A stream whose worker
ended it in-band with a server error (a replica's abort when its engine fails under the request)
is booked as failed, as one the connection cut: its 200 went out with the first byte, but the
answer is not what was asked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass

import anyio
import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from .bodies import Offloader
from .circuit import OPEN
from .config import CACHE_EPOCH_HEADER, ERROR_TYPES, RouterConfig
from .helper import HelperDied
from .metrics import RouterMetrics
from .policies import Policy, RequestInfo, least_loaded
from .request import (SSETail, answer_events, answer_facts, answer_route_texts, stream_end,
                      stream_texts)
from .headers import downstream_headers, upstream_headers
from .retry import (BREAKER_STATUS, RETRYABLE_STATUS, SUSPECT_STATUS, backoff_delay,
                    is_restarting)
from .tree import ApproxRadixTree
from .workers import Worker, WorkerRegistry

log = logging.getLogger("radixray.router")

def error_response(route: str, status: int, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the style of the route, shaped as a replica's own (SGLang's): OpenAI's for
    /v1/..., SGLang's native otherwise. A client error's message starts with its field, which
    becomes ``param``."""
    field = message.partition(":")[0] if status < 500 and ":" in message else ""
    param = field if field and " " not in field else None
    if route.startswith("/v1/"):
        kind = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "Error")
        body = {"object": "error", "message": message, "type": kind, "param": param,
                "code": status}
    else:
        body = {"error": {"message": message, "code": status, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass
class Failure:
    kind: str  # label of errors_total: connect, timeout, protocol, restarting, http_<status>
    message: str
    response: Response | None = None  # the worker's own answer, for a retryable status


async def _close(resp: httpx.Response | None) -> None:
    """Close an upstream response even while being cancelled (else the connection leaks)."""
    if resp is not None:
        with anyio.CancelScope(shield=True):
            await resp.aclose()


class UpstreamStream(StreamingResponse):
    """A StreamingResponse whose cleanup runs exactly once, whether the stream finished, failed,
    the client went away, or the body was never started."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


def worker_state(worker: Worker) -> str:
    """A worker's state in words, for messages: why it does or does not take traffic."""
    if not worker.healthy:
        return "unhealthy: no traffic until a health check passes"
    if worker.breaker.state == OPEN:
        return (f"circuit open: half-open in {worker.breaker.cooldown_left():.0f} s "
                "or at its next passing health check")
    return "available"


class Proxy:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, tree: ApproxRadixTree,
                 policy: Policy, metrics: RouterMetrics, client: httpx.AsyncClient,
                 rng: random.Random, offload: Offloader):
        self.config = config
        self.registry = registry
        self.tree = tree
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.rng = rng
        self.offload = offload  # parses large answers off the event loop

    async def forward(self, route: str, raw: bytes, info: RequestInfo, headers,
                      on_done) -> Response:
        """Route one generation request, with retries. ``on_done(status)`` is called once when
        the answer is complete (for a stream: when its last byte went out or it was cut)."""
        match = self.tree.match(info.text)
        tried: set[str] = set()
        failures: list[str] = []
        suspects: list[Worker] = []  # answered 500: blamed if another worker then answers
        last_answer: Response | None = None
        fwd = upstream_headers(headers)
        for attempt in range(self.config.max_retries + 1):
            if attempt and self.registry.available():  # no point waiting for nobody
                await asyncio.sleep(backoff_delay(attempt, self.config, self.rng))
            candidates = self.registry.available()
            if not candidates:
                break
            fresh = [w for w in candidates if w.url not in tried] or candidates
            decision = self.policy.choose(info, fresh, match)
            worker = decision.worker
            self.metrics.decisions.labels(self.policy.name, decision.kind).inc()
            predicted = match.chars_for(worker.url)  # before the insert below marks it cached
            self.tree.insert(info.text, worker.url, worker.tree_limit)
            tried.add(worker.url)
            send = self._send_stream if info.stream else self._send_once
            result, emptied = await send(worker, route, raw, fwd, info, on_done)
            if not isinstance(result, Response) or result.status_code >= 400:
                self.tree.forget(info.text, worker.url, predicted)  # it cached nothing of it
            elif emptied:
                # The worker's cache was emptied since its last answer: the tree forgot it all,
                # but this request's prefix is cached there now.
                self.tree.insert(info.text, worker.url, worker.tree_limit)
            if isinstance(result, Response):
                if result.status_code < 300:  # a refused request is no prediction to judge
                    self.metrics.record_prediction(predicted, len(info.text))
                    # the request was fine: the others failed it (each once)
                    for suspect in {id(w): w for w in suspects if w is not worker}.values():
                        suspect.breaker.record_failure()
                return result
            if result.response is not None and result.response.status_code in SUSPECT_STATUS:
                suspects.append(worker)
            self.metrics.errors.labels(worker.url, result.kind).inc()
            failures.append(f"{worker.url}: {result.message}")
            last_answer = result.response or last_answer
            if attempt < self.config.max_retries:
                self.metrics.retries.labels(worker.url).inc()
        if last_answer is not None:
            answer = last_answer  # the workers' own words beat ours
        elif not failures:
            answer = error_response(route, 503, self._no_worker_message())
        else:
            status = 503 if not self.registry.available() else 502
            answer = error_response(route, status, f"all {len(failures)} attempts failed; "
                                    + "; ".join(failures[-3:]))
        on_done(answer.status_code)
        return answer

    async def forward_plain(self, method: str, path: str, raw: bytes, headers) -> Response:
        """Forward a non-generation request (model info, health_generate) to the least loaded
        available worker, retrying elsewhere; no tree, no decision metrics."""
        tried: set[str] = set()
        failures: list[str] = []
        last_answer = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(backoff_delay(attempt, self.config, self.rng))
            candidates = self.registry.available()
            if not candidates:
                break
            worker = least_loaded([w for w in candidates if w.url not in tried] or candidates,
                                  self.rng)
            tried.add(worker.url)
            try:
                resp = await self.client.request(method, worker.url + path, content=raw or None,
                                                 headers=upstream_headers(headers))
            except httpx.HTTPError as exc:
                failure = self._transport_failure(worker, exc)
                self.metrics.errors.labels(worker.url, failure.kind).inc()
                failures.append(f"{worker.url}: {failure.message}")
                continue
            answer = Response(resp.content, resp.status_code, downstream_headers(resp.headers))
            self._observe_epoch(worker, resp)
            if resp.status_code not in RETRYABLE_STATUS:
                return answer
            failures.append(f"{worker.url}: HTTP {resp.status_code}")
            last_answer = answer
        if last_answer is not None:
            return last_answer
        if not failures:
            return error_response(path, 503, self._no_worker_message())
        return error_response(path, 502, "all attempts failed; " + "; ".join(failures[-3:]))

    def _no_worker_message(self) -> str:
        """Why no worker could take a request, naming each worker's state truthfully."""
        workers = self.registry.all()
        if not workers:
            return "no healthy worker: no workers are registered"
        prefix = "no available worker" if self.registry.healthy() else "no healthy worker"
        return f"{prefix}: " + ", ".join(f"{w.url} ({worker_state(w)})" for w in workers)

    def _transport_failure(self, worker: Worker, exc: Exception) -> Failure:
        """Account for a request that never got an answer from ``worker``."""
        worker.breaker.record_failure()
        if isinstance(exc, httpx.ConnectError):
            self.registry.mark_unhealthy(worker)  # nothing listens there: stop at once
            return Failure("connect", f"connection failed ({exc})")
        if isinstance(exc, httpx.TimeoutException):
            return Failure("timeout", f"timed out ({type(exc).__name__})")
        return Failure("protocol", f"{type(exc).__name__}: {exc}")

    def _status_failure(self, worker: Worker, status: int, answer: Response) -> Failure:
        if is_restarting(status, answer.headers):
            # Deliberate, not broken: counted as failures, a restart's few answers would open
            # the circuit of a replica about to serve again. Its new engine is not there yet,
            # so it gets no traffic until a health check passes (which also sees the new cache
            # epoch, and the registry closes its circuit).
            self.registry.mark_unhealthy(worker)
            return Failure("restarting", "HTTP 503 (replica is restarting)", answer)
        if status in BREAKER_STATUS:
            worker.breaker.record_failure()
        return Failure(f"http_{status}", f"HTTP {status}", answer)

    def _observe_epoch(self, worker: Worker, resp: httpx.Response) -> bool:
        """Read the answer's cache epoch (True: the worker's cache was emptied since)."""
        return self.registry.observe_epoch(worker, resp.headers.get(CACHE_EPOCH_HEADER))

    async def _send_once(self, worker: Worker, route, raw, fwd, info, on_done):
        """One attempt: (the answer, or a Failure; whether the worker's cache was emptied)."""
        worker.load += 1
        try:
            resp = await self.client.post(worker.url + route, content=raw, headers=fwd)
        except httpx.HTTPError as exc:
            return self._transport_failure(worker, exc), False
        finally:
            worker.load -= 1
        emptied = self._observe_epoch(worker, resp)
        answer = Response(resp.content, resp.status_code, downstream_headers(resp.headers))
        if resp.status_code in RETRYABLE_STATUS:
            return self._status_failure(worker, resp.status_code, answer), emptied
        worker.breaker.record_success()
        if resp.status_code == 200:
            worker.served += 1
            mark = self.tree.forget_count
            # Only the metrics and the tree need these: the client does not wait for them.
            def learn(facts):
                self._record_real(facts[0])
                self._learn_answer(worker, route, info, facts[1], mark)

            self.offload.book(len(resp.content), answer_facts,
                              (resp.content, info.copies, info.by_ids), learn)
        on_done(resp.status_code)
        return answer, emptied

    def _record_real(self, counts: tuple[int, int] | None) -> None:
        if counts is not None:
            self.metrics.record_real(*counts)

    def _learn_answer(self, worker: Worker, route: str, info, answers: list[str],
                      mark: int) -> None:
        """The worker cached each answer after the prompt: a conversation's next turn (the
        prompt, an answer, a new message) then matches it there, not only its first turn.
        Nothing is learned if the tree forgot whole workers since ``mark`` (a flush or a
        restart after the answer: its entries must not come back)."""
        if self.tree.forget_count != mark or worker.url not in self.registry:
            return
        for text in answer_route_texts(route, info, answers):
            self.tree.insert(text, worker.url, worker.tree_limit)

    async def _send_stream(self, worker: Worker, route, raw, fwd, info, on_done):
        """As ``_send_once``; a stream whose first byte came is committed to this worker."""
        worker.load += 1
        resp = None
        try:
            request = self.client.build_request("POST", worker.url + route, content=raw,
                                                headers=fwd)
            resp = await self.client.send(request, stream=True)
            if resp.status_code == 200:
                chunks = resp.aiter_raw()
                try:  # wait for the first byte: until then a failure can be retried elsewhere
                    first = await chunks.__anext__()
                except StopAsyncIteration:
                    first = b""
                emptied = self._observe_epoch(worker, resp)
                return self._commit_stream(worker, route, resp, first, chunks, info,
                                           on_done), emptied
            body = await resp.aread()  # an error answer is small: read it whole
        except httpx.HTTPError as exc:
            await _close(resp)
            worker.load -= 1
            return self._transport_failure(worker, exc), False
        except asyncio.CancelledError:
            await _close(resp)
            worker.load -= 1
            raise
        await _close(resp)
        worker.load -= 1
        emptied = self._observe_epoch(worker, resp)
        answer = Response(body, resp.status_code, downstream_headers(resp.headers))
        if resp.status_code in RETRYABLE_STATUS:
            return self._status_failure(worker, resp.status_code, answer), emptied
        worker.breaker.record_success()
        on_done(resp.status_code)
        return answer, emptied

    def _commit_stream(self, worker: Worker, route: str, resp: httpx.Response, first: bytes,
                       chunks, info, on_done) -> Response:
        """Pass the rest of an upstream stream through; the cleanup settles the accounts."""
        # An OpenAI stream's answer is the sum of its events; a native one's last event holds
        # all of it (keeping every native event would hold the text many times over).
        tail = SSETail(keep_events=route != "/generate" and bool(info.text))
        mark = self.tree.forget_count
        state = {"outcome": "cut"}  # finished | failed | cut (the client went away)
        # The 200 went out with the first byte; the books record how the stream ended.
        status_of = {"finished": 200, "failed": 502, "cut": 499}

        async def body():
            tail.feed(first)
            if first:
                yield first
            try:
                async for chunk in chunks:
                    tail.feed(chunk)
                    yield chunk
                state["outcome"] = "finished"
            except httpx.HTTPError as exc:
                state["outcome"] = "failed"
                self.metrics.errors.labels(worker.url, "stream").inc()
                error = {"error": {"message": f"worker {worker.url} failed mid-stream: "
                                              f"{type(exc).__name__}", "type": ERROR_TYPES[502],
                                   "code": 502}}  # ended as a replica ends its own errors
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

        async def settle() -> None:
            """Judge how the stream ended, and book it on the worker and the metrics."""
            if state["outcome"] == "cut" and tail.done:
                # the client hung up after the last event (SGLang's frontend closes at
                # [DONE]) but before the upstream's end of stream: it got everything
                state["outcome"] = "finished"
            if state["outcome"] == "finished":
                try:
                    counts, failed = await self.offload.parse_answer(
                        tail.size, stream_end, tail.last_events, info.copies)
                except HelperDied:  # logged by the helper; the stream's end is unknown
                    counts, failed = None, None
                if failed:  # ended in-band with a server error: the worker failed it
                    state["outcome"] = "failed"
                    self.metrics.errors.labels(worker.url, "stream").inc()
                else:
                    self._record_real(counts)
                    events = answer_events(route, tail, info.copies)
                    if events:  # in the background: the client's slot is freed meanwhile
                        self.offload.book(
                            sum(map(len, events)), stream_texts, (events, info.by_ids),
                            lambda answer: self._learn_answer(worker, route, info, answer, mark))
            outcome = state["outcome"]
            if outcome == "finished":
                worker.breaker.record_success()
                worker.served += 1
            elif outcome == "failed":
                worker.breaker.record_failure()
            # cut: the client left; no verdict on the worker

        async def cleanup():
            # on_done frees the request's admission slot and counts it: whatever fails here,
            # it must run (else every such failure would leak a slot for good).
            try:
                try:
                    await _close(resp)  # before the end of a stream, aborts the upstream request
                finally:
                    worker.load -= 1
                await settle()
            except Exception:
                log.exception("router: settling a stream from %s failed", worker.url)
            finally:
                on_done(status_of[state["outcome"]])

        return UpstreamStream(body(), cleanup, status_code=200,
                              headers=downstream_headers(resp.headers))
