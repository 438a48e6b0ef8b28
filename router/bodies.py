"""Request and answer bodies: the size limit, and reading large ones off the event loop.

``read_body`` refuses a body over ``--max-payload-size`` with 413: at once when its
Content-Length says so, else as soon as the bytes read pass the limit (a chunked upload).

The router's one event loop serves every client, so a body must not be parsed on it for long.
A worker thread does not help here: ``json.loads`` holds the GIL for the whole parse (a 30 MB
batch of short prompts took 1.9 s and stalled the loop 1.7 s from a thread, as much as inline;
a replica gains from a thread because its tokenizer releases the GIL). So ``Offloader`` runs
the parse of a body of ``LARGE_BODY_BYTES`` or more in a helper process, which sends back only
what the router needs (request.py's ``read_request``, ``answer_counts``, ``stream_end``), never
the parsed body. Smaller bodies parse inline, quicker than the round trip.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from starlette.exceptions import HTTPException
from starlette.requests import Request

log = logging.getLogger("radixray.router")

# As the replicas' threshold (cluster/generation.py): a smaller body parses in a few ms.
LARGE_BODY_BYTES = 64 << 10


class PayloadTooLarge(HTTPException):
    """413, in the route's error shape (the app's HTTPException handler renders it)."""

    def __init__(self, limit: int):
        super().__init__(413, f"body: larger than the router's limit of {limit} bytes "
                              "(--max-payload-size)")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; PayloadTooLarge past ``limit`` bytes, before reading what is left."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _start_helper() -> None:
    """Runs first in the helper process."""
    # Ctrl-C reaches the whole process group: the router shuts its helper down itself, so the
    # helper should not die first with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A router killed without its shutdown (SIGKILL, or uvicorn re-raising SIGTERM before the
    # pool's own exit hook ran) would leave the helper waiting for work forever: it holds both
    # ends of its work queue, so it never reads an end of file. It leaves with its parent.
    parent = multiprocessing.parent_process()

    def exit_with_parent():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()


class Offloader:
    """Runs ``fn(*args)``, a pure function of a body, inline for a small body and in a helper
    process for a large one. One process, started on the first large body (a fresh interpreter,
    "spawn": forking a process that runs threads is unsafe); large bodies are rare, so they
    take turns there rather than hold a process each. Where no process can be started, or the
    helper died, a thread does the work (correct, only not off the GIL)."""

    def __init__(self):
        self._pool: ProcessPoolExecutor | None = None
        self._no_process = False

    async def run(self, size: int, fn, *args):
        if size < LARGE_BODY_BYTES:
            return fn(*args)
        pool = self._helper()
        if pool is not None:
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
            except (BrokenProcessPool, OSError) as exc:
                # killed (out of memory, by hand) or not started: the next large body starts
                # a fresh one (unless a concurrent body already did)
                log.warning("no body parsing helper process (%r); starting another", exc)
                if self._pool is pool:
                    self._pool = None
                pool.shutdown(wait=False)
        return await asyncio.to_thread(fn, *args)

    def _helper(self) -> ProcessPoolExecutor | None:
        if self._pool is None and not self._no_process:
            try:
                self._pool = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_helper)
            except (OSError, NotImplementedError, ImportError) as exc:  # no semaphores here
                log.warning("large bodies are parsed in a thread: no helper process (%s)", exc)
                self._no_process = True
        return self._pool

    def close(self, wait: bool = False) -> None:
        """Stop the helper; ``wait``: until it has exited (the router's shutdown, in a thread:
        the process may exit right after, before the pool's exit hook would have run)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
