"""Engine metrics for one replica, in Prometheus form (prometheus-client).

Every metric is named `radixray:<name>` (the colon style SGLang uses with `sglang:`) and carries
the labels `model_name` and `replica`. The metrics live on a `CollectorRegistry` the caller
passes in, never the process-global one, so several replicas (or tests) in one process do not
collide and a replica's `/metrics` shows exactly its own figures.

Two ways figures arrive:
- `update_scheduler_stats(stats)`: a snapshot the scheduler actor reports now and then (gauges,
  plus counters as cumulative totals). Totals are turned into counter increments here, so the
  HTTP process never asks the scheduler anything per request.
- `observe_request(...)`: one finished request's latencies, measured by the HTTP process.
"""

from __future__ import annotations

import math
import numbers
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

# One content type for every /metrics (router/metrics.py says why the classic text format)
from ..router.metrics import EXPOSITION_CONTENT_TYPE  # noqa: F401 (re-exported)

PREFIX = "radixray:"
LABELS = ("model_name", "replica")

GAUGES = {
    "num_running_reqs": "Requests in the running batch.",
    "num_queue_reqs": "Requests waiting in the scheduler queue.",
    "num_grammar_queue_reqs": "Requests waiting for their grammar to compile.",
    "token_usage": "Fraction of KV-cache slots in use (0..1).",
    "cache_hit_rate": "Fraction of prompt tokens served from the radix cache since the "
                      "replica started (0..1).",
    "gen_throughput": "Generated tokens per second over the last reporting interval.",
    "new_token_ratio": "Current estimate of the fraction of max_new_tokens a request will use.",
    "kv_available_tokens": "KV-cache slots free right now.",
    "kv_evictable_tokens": "KV-cache slots held only by the radix cache (evictable).",
}

# Keys as the scheduler reports them (cumulative totals); the exported names are the same.
COUNTERS = {
    "prompt_tokens_total": "Prompt tokens received.",
    "generation_tokens_total": "Tokens generated.",
    "cached_tokens_total": "Prompt tokens served from the radix cache.",
    "host_cached_tokens_total": "Of cached_tokens_total, those loaded back from the host-memory "
                                "tier (hierarchical cache).",
    "hicache_copy_failures_total": "Batches whose device<->host KV copies failed on a worker "
                                   "(hierarchical cache); what they carried is recomputed.",
    "num_requests_total": "Requests finished (any reason).",
    "num_aborted_requests_total": "Requests aborted (client gone, abort call, error).",
    "num_retracted_reqs_total": "Running requests retracted to free KV-cache memory.",
    "evicted_tokens_total": "Tokens evicted from the radix cache's device tier (also to make "
                            "room for host-tier loads).",
    "engine_restarts_total": "Times a Ray replica restarted its ranks (a rank died or a step "
                             "hung); kept across head restarts.",
    "head_restarts_total": "Times Ray restarted a replica's head actor (its process died).",
}

# SGLang's TTFT buckets start at 0.1 s; tiny models on CPU answer in a few milliseconds, so
# finer buckets below 0.1 s keep the p50/p99 panels meaningful there. The GPU range is kept.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0,
                20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04,
               0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
               120.0, 300.0, 600.0, 1200.0, 2400.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0, 600.0)

HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival to the first output token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive output tokens.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival to the last output token.", E2E_BUCKETS),
    "queue_time_seconds": ("Time a request waited before its first prefill.", QUEUE_BUCKETS),
}


class EngineMetrics:
    """The metrics of one replica, registered on `registry` with fixed label values."""

    def __init__(self, registry: CollectorRegistry, model_name: str, replica: str | int):
        if not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a prometheus_client CollectorRegistry, "
                            f"got {type(registry).__name__}")
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        labels = {"model_name": str(model_name), "replica": str(replica)}
        # Children are created up front so every series is exported (at 0) from the start:
        # dashboards and `absent()` alerts then see the replica before its first request.
        self.gauges = {name: Gauge(PREFIX + name, doc, LABELS, registry=registry).labels(**labels)
                       for name, doc in GAUGES.items()}
        # prometheus-client strips a trailing `_total` from a counter's name and adds it back
        # on the sample, so passing the full name exports exactly `radixray:<name>`.
        self.counters = {name: Counter(PREFIX + name, doc, LABELS, registry=registry)
                         .labels(**labels) for name, doc in COUNTERS.items()}
        self.histograms = {name: Histogram(PREFIX + name, doc, LABELS, registry=registry,
                                           buckets=buckets).labels(**labels)
                           for name, (doc, buckets) in HISTOGRAMS.items()}
        self._last_totals = {name: 0.0 for name in COUNTERS}
        self._lock = threading.Lock()

    def update_scheduler_stats(self, stats: dict) -> None:
        """Apply one scheduler snapshot: sets the gauges present in `stats` and increments each
        counter by how much its cumulative total grew since the previous snapshot.

        Keys must be gauge names or counter names (`prompt_tokens_total`, ...); keys left out
        are left unchanged. A total lower than the last one means the scheduler restarted and
        counts from zero again: the new total is then the increment, so counters never go down.
        """
        for key, value in stats.items():
            if key not in GAUGES and key not in COUNTERS:
                raise ValueError(f"unknown scheduler stat {key!r}; expected one of "
                                 f"{sorted(GAUGES) + sorted(COUNTERS)}")
            _check_number(key, value)
            if key in COUNTERS and value < 0:
                raise ValueError(f"scheduler stat {key!r} is a cumulative total and must be "
                                 f">= 0, got {value}")
        with self._lock:
            for key, value in stats.items():
                if key in GAUGES:
                    self.gauges[key].set(value)
                    continue
                last = self._last_totals[key]
                increment = value - last if value >= last else value
                if increment:
                    self.counters[key].inc(increment)
                self._last_totals[key] = float(value)

    def observe_request(self, ttft: float | None, itl_list, e2e: float,
                        queue_time: float | None) -> None:
        """Record one finished request in the four latency histograms (seconds).

        `ttft` and `queue_time` may be None for a request that never reached its first token
        (e.g. aborted while queued); `itl_list` holds one gap per token after the first.
        """
        for field, value in (("ttft", ttft), ("queue_time", queue_time)):
            if value is not None:
                _check_duration(field, value)
        _check_duration("e2e", e2e)
        gaps = list(itl_list or ())
        for i, gap in enumerate(gaps):
            _check_duration(f"itl_list[{i}]", gap)
        if ttft is not None:
            self.histograms["time_to_first_token_seconds"].observe(ttft)
        if queue_time is not None:
            self.histograms["queue_time_seconds"].observe(queue_time)
        self.histograms["e2e_request_latency_seconds"].observe(e2e)
        itl = self.histograms["inter_token_latency_seconds"]
        for gap in gaps:
            itl.observe(gap)


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The body for a `/metrics` response (serve it with EXPOSITION_CONTENT_TYPE)."""
    return generate_latest(registry)


def metric_names_in_exposition(text: str) -> set[str]:
    """Sample names in a Prometheus text exposition (e.g. a fetched `/metrics` body), as a
    PromQL query must spell them: histograms give `_bucket`, `_sum`, `_count`."""
    return {sample.name for family in text_string_to_metric_families(text)
            for sample in family.samples}


def exported_metric_names(registry: CollectorRegistry) -> set[str]:
    """Sample names `registry` exposes on `/metrics` right now (see metric_names_in_exposition)."""
    return metric_names_in_exposition(render_metrics(registry).decode())


def _check_number(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")


def _check_duration(field: str, value) -> None:
    _check_number(field, value)
    if value < 0:
        raise ValueError(f"{field} must be >= 0 seconds, got {value}")
