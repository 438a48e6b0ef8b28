"""Awaiting work on behalf of an HTTP client that may hang up (router and replicas alike)."""

from __future__ import annotations

import asyncio


async def until_disconnect(request, coro):
    """Await ``coro``, or cancel it and return None if the client disconnects first.

    Starlette does not cancel a handler whose client went away, so without this a client that
    hangs up on a non-streamed request (or on a stream before its first byte) leaves the work
    running to the end: the router's upstream request, a replica's generation. Cancelling it
    closes what it holds (the upstream connection, the engine streams), which aborts the
    generation and frees its KV. ``request`` is a Starlette request whose body was read.
    """

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watcher = asyncio.ensure_future(coro), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    return None if work.cancelled() else work.result()
