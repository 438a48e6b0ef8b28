"""Request and answer bodies: the size limit, and reading large ones off the event loop.

``read_body`` refuses a body over ``--max-payload-size`` with 413: at once when its
Content-Length says so, else as soon as the bytes read pass the limit (a chunked upload).

The router's one event loop serves every client, so a body must not be parsed on it for long.
A worker thread does not help here: ``json.loads`` holds the GIL for the whole parse (a 30 MB
batch of short prompts took 1.9 s and stalled the loop 1.7 s from a thread, as much as inline;
a replica gains from a thread because its tokenizer releases the GIL). So ``Offloader`` runs
the parse of a body of ``LARGE_BODY_BYTES`` or more in a helper process (helper.py), which sends
back only what the router needs (request.py's ``read_request``, ``answer_counts``,
``stream_end``), never the parsed body. Smaller bodies parse inline, quicker than the round trip.

Three helpers, so that no client waits for a parse it does not need:

- request bodies under ``HUGE_BODY_BYTES`` have one: any of them parses within ~60 ms (1 MiB of
  short strings), so a long prompt waits at most that long per body ahead of it;
- larger request bodies have another: a 256 MiB batch takes seconds, and holds up only bodies
  as large;
- answers have the third. Their parse only feeds the token metrics, so ``book`` returns at once
  and books the counts when they come; the client has its answer meanwhile, and no request body
  ever queues behind an answer. Should answers come faster than their helper parses them, one
  that would take the bytes waiting past ``ANSWER_BACKLOG_BYTES`` goes uncounted rather than
  held in memory (the hit rate, a ratio, stays fair; the token totals then fall short).

The two request helpers start with the router, the answers' with the first large answer.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request

from .helper import Helper, HelperDied

log = logging.getLogger("radixray.router")

# As the replicas' threshold (cluster/generation.py): a smaller body parses in a few ms.
LARGE_BODY_BYTES = 64 << 10
HUGE_BODY_BYTES = 1 << 20  # and larger: the second request helper (above)
ANSWER_BACKLOG_BYTES = 64 << 20  # of answers waiting for their counts, at most


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


class Offloader:
    """Runs ``fn(*args)``, a pure function of a body, inline for a small body and in a helper
    process for a large one (the module's docstring says which)."""

    def __init__(self):
        self._bodies = Helper("request bodies under 1 MiB")
        self._huge = Helper("request bodies of 1 MiB or more")
        self._answers = Helper("answers")
        self._booking: set[asyncio.Task] = set()  # referenced, or a task may be collected
        self._backlog = 0  # bytes of the answers in ``_booking``

    def start(self) -> None:
        """Start the request bodies' helpers now (in threads), so that no client waits for an
        interpreter to start (0.4-1 s)."""
        self._bodies.start()
        self._huge.start()

    async def run(self, size: int, fn, *args):
        """``fn(*args)`` of a request body of ``size`` bytes; HelperDied if its helper process
        died under it (the caller answers 503: parsing it in the router could kill the router)."""
        if size < LARGE_BODY_BYTES:
            return fn(*args)
        return await (self._huge if size >= HUGE_BODY_BYTES else self._bodies).run(fn, *args)

    async def parse_answer(self, size: int, fn, *args):
        """``fn(*args)`` of an answer the caller must wait for (a stream's end decides its
        outcome); HelperDied as ``run``."""
        if size < LARGE_BODY_BYTES:
            return fn(*args)
        return await self._answers.run(fn, *args)

    def book(self, size: int, fn, args: tuple, then) -> None:
        """``then(fn(*args))`` for an answer of ``size`` bytes, without waiting: at once for a
        small answer, else in the background once the answers' helper has parsed it. Metrics
        only: a failure is logged, never raised."""
        if size < LARGE_BODY_BYTES:
            try:
                then(fn(*args))
            except Exception:
                log.exception("router: reading an answer's token counts failed")
            return
        if self._backlog and self._backlog + size > ANSWER_BACKLOG_BYTES:
            log.debug("router: %d bytes of answers wait for their token counts; "
                      "one of %d bytes goes uncounted", self._backlog, size)
            return
        self._backlog += size
        task = asyncio.get_running_loop().create_task(self._book(size, fn, args, then))
        self._booking.add(task)
        task.add_done_callback(self._booking.discard)

    async def _book(self, size: int, fn, args: tuple, then) -> None:
        try:
            then(await self._answers.run(fn, *args))
        except HelperDied:
            pass  # logged by the helper; an answer's counts are not worth a parse in the router
        except Exception:
            log.exception("router: reading an answer's token counts failed")
        finally:
            self._backlog -= size

    async def aclose(self) -> None:
        """The router's shutdown: answers still waiting for their counts go uncounted, and the
        helpers exit (waited for in a thread: the process may exit right after, before the
        pools' own exit hooks would have run)."""
        for task in self._booking:
            task.cancel()
        await asyncio.gather(*self._booking, return_exceptions=True)
        await asyncio.to_thread(self.close, True)

    def close(self, wait: bool = False) -> None:
        """Stop the helpers; later jobs (a stream ending during shutdown) run in a thread."""
        for helper in (self._bodies, self._huge, self._answers):
            helper.close(wait)
