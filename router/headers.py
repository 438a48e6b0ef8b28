"""Which headers the router passes between a client and a worker, and in what form."""

from __future__ import annotations

# Not forwarded in either direction: connection-level headers, and headers the HTTP stacks on
# each side recompute. Upstream compression is refused so bytes pass through as they are.
HOP_HEADERS = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-connection", "proxy-authenticate", "proxy-authorization",
    "accept-encoding", "content-encoding", "date", "server",
})


def upstream_headers(headers) -> list[tuple[bytes, bytes]]:
    """The client's headers for the worker, as the raw bytes they came in: a value with a
    byte past ASCII (``User-Agent: café``, valid HTTP) made httpx raise on the decoded text,
    and every proxied route answered 500."""
    raw = getattr(headers, "raw", None)
    pairs = raw if raw is not None else [(k.encode("latin-1"), v.encode("latin-1"))
                                         for k, v in headers.items()]
    out = [(k, v) for k, v in pairs if k.decode("latin-1").lower() not in HOP_HEADERS]
    out.append((b"accept-encoding", b"identity"))
    return out


def downstream_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
