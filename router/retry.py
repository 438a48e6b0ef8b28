"""When to retry and how long to wait: exponential backoff with jitter.

A request is retried on a connection error, a timeout, or one of ``RETRYABLE_STATUS`` (the
worker is overloaded, restarting or broken; another worker may well answer). Other statuses,
4xx above all, are the client's problem and are passed back as they are.
"""

from __future__ import annotations

import random

from .config import RESTARTING_HEADER, RouterConfig

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Statuses that count against a worker's circuit breaker: it failed, not the request.
# 408 and 429 are retried but say "busy", not "broken".
BREAKER_STATUS = frozenset({502, 503, 504})
# A 500 may be the request's doing (a bug it triggers answers 500 on every worker): it counts
# against a worker only once another worker has answered the same request. Counted at once,
# three such requests (each retried on every worker) opened every circuit: an outage for all.
SUSPECT_STATUS = frozenset({500})


def is_restarting(status: int, headers) -> bool:
    """Whether an answer is a replica's deliberate "restarting" 503 (it carries
    ``RESTARTING_HEADER``): the worker is not broken, only unavailable until its new engine
    passes a health check."""
    return status == 503 and headers.get(RESTARTING_HEADER) is not None


def backoff_delay(attempt: int, config: RouterConfig, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based):
    initial * multiplier**(attempt-1), capped, then scaled by a factor in [1-jitter, 1+jitter]."""
    base = config.retry_initial_backoff * config.retry_backoff_multiplier ** (attempt - 1)
    base = min(base, config.retry_max_backoff)
    return base * (1.0 + config.retry_jitter * (2.0 * rng.random() - 1.0))
