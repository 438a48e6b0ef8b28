"""RouterConfig: every knob of the router in one frozen dataclass.

The defaults below are the router's documented defaults (``router/README.md`` explains each).
Where SGLang's model gateway has a number for the same knob we start from it and say when we
differ and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

WORKER_API_KEY_ENV = "RADIXRAY_WORKER_API_KEY"
# Sent by a replica on every answer: changes whenever its radix cache is emptied (restart, flush),
# so the router forgets the prefixes it believed cached there.
CACHE_EPOCH_HEADER = "x-radixray-cache-epoch"
# Sent by a replica on the 503 it answers while it swaps in fresh ranks: it is not broken, only
# unavailable until its new engine passes a health check (the router then stops sending it
# traffic without counting the answer against its circuit breaker).
RESTARTING_HEADER = "x-radixray-restarting"
# Error "type" by status, as the replicas and SGLang name them (router and replica answer alike)
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "PayloadTooLargeError", 429: "TooManyRequests", 502: "BadGatewayError",
               503: "ServiceUnavailableError"}
# uvicorn's log levels (it names "trace", below debug, for the stdlib logging too)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
POLICY_NAMES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load",
                "consistent_hash")


@dataclass(frozen=True)
class RouterConfig:
    # --- serving ---------------------------------------------------------------------------------
    host: str = "127.0.0.1"  # loopback unless told otherwise; clusters pass --host 0.0.0.0
    port: int = 30000  # SGLang's port: clients written for SGLang find the router where they expect
    worker_urls: tuple[str, ...] = ()
    log_level: str = "info"

    # --- routing ---------------------------------------------------------------------------------
    policy: str = "cache_aware"
    # A request goes to the worker holding its longest prefix only when that prefix covers at least
    # this fraction of it. SGLang's Rust gateway uses 0.5 (its older Python router 0.3): below half,
    # the uncached part dominates the prefill cost, so spreading load is worth more than affinity.
    cache_threshold: float = 0.5
    # Imbalance override: when max - min in-flight > abs AND max > min * rel, go to the least loaded
    # worker. abs 32 is the Rust gateway's; rel 1.5 is the Python router's (the Rust 1.1 overrides
    # affinity on small relative gaps, which costs hit rate on 2-4 replicas for little spread).
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    # Characters of request text kept per worker. 2**23 ~ 8M chars ~ 2M tokens, about the KV
    # capacity of one large GPU for a 7-8B model. SGLang keeps 2**26; a tree far larger than the
    # engine's cache predicts hits the engine has already evicted, and costs router memory.
    max_tree_size: int = 2**23
    # A tree larger than the engine's cache predicts hits the engine has evicted (in the
    # simulation, a tree 200x the engine cache cut the real hit rate from 0.88 to 0.82). So each
    # worker's bound drops to its KV capacity (max_total_num_tokens from /get_server_info, read
    # after its first good health check) x this many characters per token; 0 turns this off.
    # 4 is the usual characters-per-token of English BPE text (token-id requests map 1:1).
    tree_chars_per_token: float = 4.0
    # The bound is enforced on every insert; this periodic sweep is a safety net that also drops
    # entries of workers that are gone. SGLang: 60 s.
    eviction_interval: float = 60.0

    # --- health and reliability ------------------------------------------------------------------
    # /health runs a real generation on the worker, so checks are not free; 10 s (SGLang: 60 s)
    # keeps a dead worker's traffic window short. Connection failures seen while proxying mark a
    # worker unhealthy at once, without waiting for the next check.
    health_check_interval: float = 10.0
    health_check_timeout: float = 20.0  # a busy engine queues the check behind its batch
    health_failure_threshold: int = 3  # consecutive failed checks before a worker is unhealthy
    # Retries: each retry goes to a worker not yet tried when one is left. 3 retries try every
    # replica of a 2-4 replica deployment (SGLang: 5). Backoff as SGLang: 50 ms x1.5, jitter 0.2.
    max_retries: int = 3
    retry_initial_backoff: float = 0.05
    retry_max_backoff: float = 30.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter: float = 0.2
    # Circuit breaker, SGLang's numbers: open after 10 failures within 120 s, half-open after 60 s,
    # close after 3 successes. Dead workers are caught sooner by the health checks; the breaker is
    # for flapping ones, for which a long cool-down is right.
    breaker_failure_threshold: int = 10
    breaker_window: float = 120.0
    breaker_cooldown: float = 60.0
    breaker_success_threshold: int = 3
    # Admission: beyond max_concurrent_requests in flight, up to queue_size requests wait (at most
    # queue_timeout s) in the router, where they can still go to any worker; beyond that, 429.
    # 256 in flight is several full decode batches for 2-4 replicas. <= 0 disables the limit.
    max_concurrent_requests: int = 256
    queue_size: int = 128
    queue_timeout: float = 60.0
    request_timeout: float = 1800.0  # SGLang's; long generations are legitimate
    # Request bodies larger than this many bytes are refused with 413 (SGLang's gateway: 256 MiB,
    # its --max-payload-size). The router holds a body whole while it routes and forwards it.
    max_payload_size: int = 256 << 20
    # On SIGTERM, requests in flight get this long to finish, then are cut: within Kubernetes'
    # default 30 s grace period, and a long generation cannot hold a shutdown for minutes.
    shutdown_timeout: float = 25.0
    connect_timeout: float = 5.0

    # --- Ray discovery ---------------------------------------------------------------------------
    ray_address: str | None = None
    ray_namespace: str = "radixray"
    ray_actor_prefix: str = "replica:"
    discovery_interval: float = 5.0

    seed: int | None = None  # seeds the random tie-breaks (tests, simulations)
    # The key of workers started with --api-key, for the router's own requests to them (its
    # /get_server_info read); clients' requests carry their own. From the environment only
    # (WORKER_API_KEY_ENV), never a flag, so it does not show in process listings.
    worker_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "worker_urls", tuple(self.worker_urls))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for f in fields(self):
            # NaN passes every comparison below, and inf overflows where a number becomes an
            # int (a worker's tree bound): no knob means "unbounded" by an infinite value.
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name}: must be a finite number, got {value}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.log_level!r}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy: must be one of {', '.join(POLICY_NAMES)}, "
                             f"got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold: must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold: must be >= 1")
        if self.max_tree_size < 1:
            raise ValueError("max_tree_size: must be >= 1 character")
        if self.tree_chars_per_token < 0:
            raise ValueError("tree_chars_per_token: must be >= 0 (0 disables)")
        if self.max_retries < 0:
            raise ValueError("max_retries: must be >= 0")
        if self.queue_size < 0:
            raise ValueError("queue_size: must be >= 0")
        if self.max_payload_size < 1:
            raise ValueError("max_payload_size: must be >= 1 byte")
        for name in ("eviction_interval", "health_check_interval", "health_check_timeout",
                     "retry_initial_backoff", "retry_max_backoff", "breaker_window",
                     "breaker_cooldown", "queue_timeout", "request_timeout", "connect_timeout",
                     "shutdown_timeout", "discovery_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        for name in ("health_failure_threshold", "breaker_failure_threshold",
                     "breaker_success_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.retry_backoff_multiplier < 1.0:
            raise ValueError("retry_backoff_multiplier: must be >= 1")
        if not 0.0 <= self.retry_jitter < 1.0:
            raise ValueError("retry_jitter: must be in [0, 1)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        from .workers import normalize_url  # (workers imports this module)

        for url in self.worker_urls:
            try:
                normalize_url(url)
            except ValueError as exc:
                raise ValueError(f"worker_urls: {exc}") from None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
