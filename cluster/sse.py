"""Server-sent events: their framing, the in-band error event, and ``open_stream``, which
sends a stream's status line with its first event."""

from __future__ import annotations

import json

from .api_errors import APIError
from .generation import Session, until_disconnect


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ErrorEvent(str):
    """An SSE event reporting ``error`` (an ``APIError``). ``open_stream`` turns one that comes
    before any output into the HTTP error itself."""

    error: APIError


def error_event(err: APIError, native: bool = False) -> ErrorEvent:
    """The in-band error event: OpenAI's error object, or SGLang's ``message`` and ``code``."""
    fields = ({"message": err.message, "code": err.code} if native else
              {"message": err.message, "type": err.err_type, "param": err.param,
               "code": err.code})
    event = ErrorEvent(sse({"error": fields}))
    event.error = err
    return event


async def open_stream(request, events, session: Session):
    """The SSE response of ``events``, whose status line goes out with the first event. An
    error before any output (a replica that restarts under the request, a grammar that does
    not compile) is then the HTTP error itself: a 503 the router retries on another replica, a
    400 the client's library raises. Only errors after the first event come in-band. Waiting
    for the first event costs nothing: it is what the client waits for anyway."""
    from starlette.background import BackgroundTask
    from starlette.responses import StreamingResponse

    first = await until_disconnect(request, anext(events))
    if isinstance(first, ErrorEvent) or not isinstance(first, str):  # or the 499
        await events.aclose()
        session.close()
        if isinstance(first, ErrorEvent):
            raise first.error
        return first

    async def replay():
        try:
            yield first
            async for event in events:
                yield event
        finally:  # a client gone mid-stream: close the requests now, not when collected
            await events.aclose()

    return StreamingResponse(replay(), media_type="text/event-stream",
                             background=BackgroundTask(session.close))

