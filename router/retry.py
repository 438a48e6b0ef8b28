"""When to retry and how long to wait: exponential backoff with jitter.

A request is retried on a connection error, a timeout, or one of ``RETRYABLE_STATUS`` (the
worker is overloaded, restarting or broken; another worker may well answer). Other statuses,
4xx above all, are the client's problem and are passed back as they are.
"""

from __future__ import annotations

import json
import random

from .config import RouterConfig

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Statuses that count against a worker's circuit breaker: it failed, not the request.
# 408 and 429 are retried but say "busy", not "broken".
BREAKER_STATUS = frozenset({500, 502, 503, 504})
# A radixray replica swapping in fresh ranks answers generation requests with a 503 carrying
# exactly this message, in its error shape (cluster/replica.py: RestartGate, and
# SwappableEngine._engine via generation.py's APIError(503, ...) when the engine goes away
# between the gate and the call). It sends no header to mark it (and no cache epoch: it has no
# engine), so the message is the marker.
RESTARTING_MESSAGE = "replica is restarting"


def is_restarting(status: int, body: bytes) -> bool:
    """Whether an answer is a replica's deliberate "restarting" 503: the worker is not broken,
    only unavailable until its new engine passes a health check."""
    if status != 503:
        return False
    try:
        payload = json.loads(body)
    except (ValueError, TypeError):
        return False
    if not isinstance(payload, dict):
        return False
    error = payload.get("error")  # SGLang's native shape; OpenAI's has the message on top
    message = error.get("message") if isinstance(error, dict) else payload.get("message")
    return message == RESTARTING_MESSAGE


def backoff_delay(attempt: int, config: RouterConfig, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based):
    initial * multiplier**(attempt-1), capped, then scaled by a factor in [1-jitter, 1+jitter]."""
    base = config.retry_initial_backoff * config.retry_backoff_multiplier ** (attempt - 1)
    base = min(base, config.retry_max_backoff)
    return base * (1.0 + config.retry_jitter * (2.0 * rng.random() - 1.0))
