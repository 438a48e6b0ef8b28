"""What the HTTP layer says to an engine, and what it hears back.

The HTTP server tokenizes, submits a ``GenerateRequest`` and reads a stream of ``TokenOutput``
(one per scheduler step that touched the request; ``finished`` on the last). Detokenization,
stop-string trimming and response formats are the HTTP layer's job; the engine only deals in
token ids. Two engines implement ``EngineClient``: the in-process one (a thread running the
scheduler; no Ray) and a Ray replica (scheduler head actor plus worker actors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from ..worker.sampling_params import SamplingParams

# How long a replica's /health waits for its one-token generation by default. Below the
# router's own limit (router/config.py, 20 s), so the router hears the verdict on a busy
# replica (healthy: it made progress) before it gives up on the check.
HEALTH_CHECK_TIMEOUT_S = 15.0

# (logprob, token id); text is added by the HTTP layer when asked
LogprobEntry = tuple[float, int]


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs
    top_logprobs_num: int = 0
    priority: int = 0
    routing_key: str | None = None
    extra_key: str | None = None  # cache_salt / adapter id: never share a prefix across keys
    probe: bool = False  # a health check: kept out of the metrics' counters


@dataclass
class TokenOutput:
    rid: str
    new_token_ids: list[int]
    finished: bool = False
    # SGLang shape: {"type": "stop", "matched": id|str} | {"type": "length", "length": n}
    # | {"type": "abort", "message": str}
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier (hicache)
    completion_tokens: int = 0
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)  # for new tokens
    output_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    # sent once, on the request's first output; the first entry's logprob is None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    queue_time: float | None = None  # seconds waiting before the first forward (first output)


class EngineClient(Protocol):
    """Async face of an engine; safe to call from the HTTP server's event loop."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Submit and stream. Closing the iterator early (client gone) aborts the request."""
        ...

    async def abort(self, rid: str) -> None: ...

    async def flush_cache(self) -> bool:
        """Drop the radix cache. False when requests are running (nothing is flushed)."""
        ...

    def cache_epoch(self) -> str:
        """Changes whenever the radix cache is emptied (a new engine, a flush); the HTTP server
        sends it on every answer so that the router notices. "": no cache right now."""
        ...

    async def health_check(self, timeout: float) -> bool:
        """Run a one-token generation through the real scheduler and model path."""
        ...

    def server_info(self) -> dict:
        """Static arguments plus scheduler figures such as max_total_num_tokens."""
        ...

    def stats(self) -> dict:
        """Latest scheduler figures for metrics (gauges and cumulative counters)."""
        ...
