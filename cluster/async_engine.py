"""``InProcessEngine``: an ``EngineClient`` over a scheduler driven by one background thread.

The thread owns the ``Scheduler`` (nothing else touches it): it takes commands (submit, abort,
flush, calls) from a queue, runs ``step()`` while there is work, and hands each output to the
asyncio queue of its request through ``loop.call_soon_threadsafe``. With nothing to do it
waits on a condition variable; no busy loop. If a step raises, every live request is finished
with an abort reason (nobody hangs), the engine marks itself failed and stops: health checks
then fail, so an orchestrator restarts the replica.

Every replica head (``cluster/replica.py``) and the offline ``Engine`` run on this engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
import uuid
from collections import deque
from typing import AsyncIterator, Callable

from ..scheduler.request import Req, RequestOutput
from ..worker.sampling_params import SamplingParams
from .engine_protocol import GenerateRequest, TokenOutput

log = logging.getLogger(__name__)
THROUGHPUT_WINDOW_S = 1.0  # gen_throughput is averaged over about this long


class InProcessEngine:
    def __init__(self, scheduler, server_info: dict | None = None,
                 health_input_ids: list[int] | None = None):
        """``scheduler``: a ``Scheduler`` no other thread uses. ``server_info``: static figures
        to report (model path, arguments). Call ``start()`` before use."""
        self.scheduler = scheduler
        self._info = dict(server_info or {})
        self._health_ids = list(health_input_ids or [0])
        self._inbox: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Set (under _cond) once the thread has stopped taking commands: later ones fail at
        # once instead of waiting in an inbox nobody reads.
        self._closed: str | None = None
        self.failure: BaseException | None = None
        self.steps = 0  # forward steps done; health checks use it to tell busy from stuck
        self._stats: dict = {}
        # Requests this engine failed when it stopped (live ones and submissions it never
        # took): the scheduler, which counts the others, never finished them.
        self._failed_at_stop = 0
        self._failed_prompt_tokens = 0  # their prompts' tokens
        self._tp = (time.monotonic(), 0)  # (time, generated tokens) at the last throughput mark
        self._throughput = 0.0
        self.tokenizer = None  # set by from_model
        # Names what this engine's radix cache holds: new per engine (a restarted replica builds
        # a new one), bumped by each flush. The router drops its picture of a worker's cache
        # when the epoch it sees changes.
        self._cache_id, self._flushes = uuid.uuid4().hex[:12], 0

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def from_model(cls, model_path: str, **server_args) -> "InProcessEngine":
        """Load tokenizer and model and build the scheduler (as the offline ``Engine`` does,
        with its server-argument names), then start the thread. ``.tokenizer`` is set."""
        from .engine import Engine

        offline = Engine(model_path, **server_args)
        runner = offline.runner
        info = {**offline.server_args, "model_path": model_path, "engine": "in-process",
                "max_total_num_tokens": runner.max_total_tokens,
                "max_running_requests": runner.max_running_requests,
                "max_context_len": runner.max_context_len,
                "vocab_size": runner.model_config.vocab_size}
        bos = offline.tokenizer.bos_token_id
        engine = cls(offline.scheduler, info, health_input_ids=[bos if bos is not None else 0])
        engine.tokenizer = offline.tokenizer
        engine.start()
        return engine

    def start(self) -> None:
        """Start the scheduler thread (``from_model`` already did); only one may ever run."""
        if self._thread is not None:
            raise RuntimeError("engine already started: two threads would step one scheduler")
        self._thread = threading.Thread(target=self._run, name="radixray-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still live end with an abort reason."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        close = getattr(self.scheduler.runner, "close", None)  # an in-process ModelRunner's
        if close is not None and self.stopped:  # forward thread (overlap scheduling)
            close()

    @property
    def stopped(self) -> bool:
        """Its thread has ended (or never began): its counters change no more."""
        return self._thread is None or not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.failure is None)

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Submit ``req`` and yield its outputs. Raises ValueError("field: ...") when the
        scheduler rejects it. Closing the iterator before the end aborts the request."""
        r = Req(req.rid, req.input_ids, req.sampling_params, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                priority=req.priority, routing_key=req.routing_key, extra_key=req.extra_key,
                probe=req.probe)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        if not self.alive:
            raise RuntimeError(f"engine is not running ({self.failure or 'stopped'})")
        self._send(("add", r, loop, queue))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):  # refused: it never entered the scheduler
                    finished = True  # so no abort, which would hit another request with this rid
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # only this one: another request may have this rid by now
                self._send(("abort", req.rid, r))

    async def abort(self, rid: str) -> None:
        self._send(("abort", rid))

    async def flush_cache(self) -> bool:
        flushed = await self.call(lambda s: s.flush_cache())
        if flushed:
            self._flushes += 1
        return flushed

    def cache_epoch(self) -> str:
        return f"{self._cache_id}.{self._flushes}"

    async def health_check(self, timeout: float) -> bool:
        """One greedy token through the real scheduler and model. A timeout still counts as
        healthy if steps were made meanwhile (busy, not stuck)."""
        if not self.alive:
            return False
        steps = self.steps
        req = GenerateRequest(f"health-{uuid.uuid4().hex}", self._health_ids,
                              SamplingParams(max_new_tokens=1, temperature=0.0), probe=True)

        async def one_token() -> bool:
            last = None
            async for last in self.generate(req):
                pass
            return last is not None and last.finish_reason.get("type") != "abort"

        try:
            return await asyncio.wait_for(one_token(), timeout)
        except asyncio.TimeoutError:
            return self.alive and self.steps > steps
        except (RuntimeError, ValueError):
            return False

    def server_info(self) -> dict:
        return dict(self._info)

    def stats(self) -> dict:
        stats = dict(self._stats)
        if self._failed_at_stop:
            for key in ("num_requests_total", "num_aborted_requests_total"):
                stats[key] = stats.get(key, 0) + self._failed_at_stop
            stats["prompt_tokens_total"] = (stats.get("prompt_tokens_total", 0)
                                            + self._failed_prompt_tokens)
        return stats

    # ------------------------------------------------------------------ test / debug helpers
    async def call(self, fn: Callable, timeout: float | None = None):
        """Run ``fn(scheduler)`` on the engine thread between steps; return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def call_sync(self, fn: Callable, timeout: float | None = 30.0):
        """``call`` for code outside any event loop (tests, the command line)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, future))
        return future.result(timeout)

    def check_invariant(self) -> int:
        """Assert the scheduler's memory invariant (on its thread, between steps); returns the
        number of live requests."""
        def check(s):
            s.check_invariant()
            return len(s.live)
        return self.call_sync(check)

    # ------------------------------------------------------------------ the thread
    def _send(self, command: tuple) -> None:
        with self._cond:
            closed = self._closed
            if closed is None:
                self._inbox.append(command)
                self._cond.notify()
        if closed is not None:
            self._refuse(command, closed)

    def _refuse(self, command: tuple, message: str) -> None:
        """Fail a command the thread will never apply (its waiter gets a RuntimeError)."""
        error = RuntimeError(f"engine stopped: {message}")
        if command[0] == "add":
            if not command[1].probe:
                with self._cond:  # the engine thread and the event loop both refuse
                    self._failed_at_stop += 1
                    self._failed_prompt_tokens += command[1].prompt_len
            try:
                command[2].call_soon_threadsafe(command[3].put_nowait, error)
            except RuntimeError:  # that event loop is closed: its client is gone
                pass
        elif command[0] == "call" and command[2].set_running_or_notify_cancel():
            command[2].set_exception(error)

    def _run(self) -> None:
        s = self.scheduler
        try:
            while True:
                with self._cond:
                    while not self._inbox and not s.has_work and not self._stopping:
                        self._stats = {**self._snapshot(), "gen_throughput": 0.0}
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._inbox)
                    self._inbox.clear()
                self._apply_all(commands)
                # Step also after bare commands: aborting a waiting request queues its final
                # output, which only step() hands out (with nothing to run it does no forward).
                busy = s.has_work
                if busy or commands:
                    outputs = s.step()
                    self.steps += busy
                    self._dispatch(outputs)
                self._stats = self._snapshot()
        except Exception as e:  # keep nobody waiting; the engine is unusable after this
            self.failure = e
            log.exception("engine loop failed; every live request is aborted")
            self._fail_all(f"engine error: {client_reason(e)}")
        finally:
            self._fail_all("engine shut down")

    def _apply_all(self, commands: list[tuple]) -> None:
        """Apply ``commands`` in order, each run of aborts as one ``abort_many``: a client that
        drops a batch of many prompts sends one abort per prompt."""
        aborts: list[str] = []
        for command in commands:
            if command[0] == "abort":
                rid, only = command[1], command[2] if len(command) > 2 else None
                if only is None or self.scheduler.live.get(rid) is only:
                    aborts.append(rid)
                continue
            if aborts:
                self.scheduler.abort_many(aborts)
                aborts = []
            self._apply(command)
        if aborts:
            self.scheduler.abort_many(aborts)

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, req, loop, queue = command
            try:
                self.scheduler.add_request(req)
            except ValueError as e:
                loop.call_soon_threadsafe(queue.put_nowait, e)
                return
            self._sinks[req.rid] = (loop, queue)
        elif kind == "call":
            _, fn, future = command
            if not future.set_running_or_notify_cancel():
                return  # its caller gave up (cancelled): setting a result would raise here
            try:
                future.set_result(fn(self.scheduler))
            except Exception as e:
                future.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their requests' queues: one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.rid)
            if sink is None:
                continue
            token_out = to_token_output(out)
            if out.finished:
                del self._sinks[out.rid]
            by_loop.setdefault(sink[0], []).append((sink[1], token_out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its clients are gone
                for _, item in items:
                    if not item.finished:
                        self.scheduler.abort(item.rid, "client event loop closed")

    def _fail_all(self, message: str) -> None:
        sinks, self._sinks = self._sinks, {}
        live = self.scheduler.live  # plain data: readable even after a failed step
        counted = [rid for rid in sinks if not (rid in live and live[rid].probe)]  # no probes
        self._failed_at_stop += len(counted)
        self._failed_prompt_tokens += sum(live[rid].prompt_len for rid in counted if rid in live)
        for rid, (loop, queue) in sinks.items():
            out = TokenOutput(rid, [], finished=True,  # 503: the server's fault, retry later
                              finish_reason={"type": "abort", "message": message,
                                             "status_code": 503})
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:
                pass
        with self._cond:  # from now on _send refuses: nothing reads the inbox any more
            self._closed = self._closed or message
            leftover = list(self._inbox)  # submissions that never reached the scheduler
            self._inbox.clear()
        for command in leftover:
            self._refuse(command, message)

    def _snapshot(self) -> dict:
        stats = self.scheduler.metrics()
        now, generated = time.monotonic(), stats.get("generation_tokens_total", 0)
        last_time, last_generated = self._tp
        if now - last_time >= THROUGHPUT_WINDOW_S:
            self._throughput = (generated - last_generated) / (now - last_time)
            self._tp = (now, generated)
        stats["gen_throughput"] = self._throughput
        return stats


def client_reason(e: BaseException, limit: int = 200) -> str:
    """An engine failure in a few words for the clients it fails (the log has all of it):
    Ray's errors run to a dozen lines of actor ids and advice about the OOM killer."""
    lines = str(e).strip().splitlines()
    # and a native library's source location ("[/__w/pytorch/.../pair.cc:537] Read error")
    first = _SOURCE_LOCATION.sub("", lines[0]) if lines else ""
    text = f"{type(e).__name__}: {first}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


_SOURCE_LOCATION = re.compile(r"\[/[^\]\s]+:\d+\] ")


def _deliver(items: list[tuple[asyncio.Queue, TokenOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def to_token_output(out: RequestOutput) -> TokenOutput:
    return TokenOutput(
        rid=out.rid, new_token_ids=list(out.new_token_ids), finished=out.finished,
        finish_reason=out.finish_reason.to_dict() if out.finish_reason else None,
        prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
        host_cached_tokens=out.host_cached_tokens,
        completion_tokens=out.completion_tokens,
        output_token_logprobs=list(out.output_token_logprobs),
        output_top_logprobs=list(out.output_top_logprobs),
        input_token_logprobs=out.input_token_logprobs,
        input_top_logprobs=out.input_top_logprobs, queue_time=out.queue_time)
