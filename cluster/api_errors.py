"""The errors the HTTP layer answers with: ``APIError`` (status, message, the field at fault),
and how engine failures and aborted requests become one."""

from __future__ import annotations

from ..router.config import ERROR_TYPES, RESTARTING_HEADER


RETRY_AFTER_S = "1"


class APIError(Exception):
    """An error the client caused (or must hear about); the server formats it per API."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | int | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        # a 429 is the server's load: say when to come back (OpenAI's clients read it)
        self.headers = {"Retry-After": RETRY_AFTER_S} if status == 429 and not headers else headers
        self.message = message
        self.param = param
        self.code = code if code is not None else status
        self.err_type = err_type or error_type(status)


def error_type(status: int) -> str:
    """An error's "type" by its status, as the replicas, the router and SGLang name them."""
    return ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "Error")


class EngineRestarting(RuntimeError):
    """Raised instead of generating while a replica swaps in fresh ranks (cluster/replica.py)."""


def unavailable(e: RuntimeError) -> APIError:
    """The 503 for an engine that is not running. A restarting replica's carries
    ``RESTARTING_HEADER``: the router then knows the replica is not broken."""
    headers = {RESTARTING_HEADER: "1"} if isinstance(e, EngineRestarting) else None
    return APIError(503, str(e), err_type="ServiceUnavailableError", headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, err_type="BadRequestError")


def abort_error(finish_reason: dict | None, fields: dict[str, str] | None = None) -> APIError:
    """The error for a request that ended with an abort: its own status (400: its input; 5xx:
    the engine failed under it), else 400. An abort without one was asked for (/abort_request)
    or is about the request itself (it outgrew the KV pool): a 500 there made the router retry
    it on another replica and count it against this one's circuit breaker. A client error the
    scheduler words by a name in ``fields`` (its grammar's kind: ``"json_schema: ..."``) is
    reworded to name the client's own field (``response_format``), as the 400s before it."""
    reason = finish_reason or {}
    status, message = reason.get("status_code", 400), reason.get("message") or "no reason given"
    name, sep, problem = message.partition(": ")
    if sep and fields and name in fields and status == 400:  # not a 429: the server's load
        return APIError(status, f"{fields[name]}: {problem}", param=fields[name])
    return APIError(status, f"request aborted: {message}")


def as_api_error(e: Exception) -> APIError:
    """What a stream reports in-band when it fails after its 200: its own status if it has one."""
    return e if isinstance(e, APIError) else APIError(
        500, f"{type(e).__name__}: {e}", err_type="InternalServerError")
