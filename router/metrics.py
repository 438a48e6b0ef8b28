"""Prometheus metrics of the router, all named ``radixray_router:<name>``.

Each router owns its CollectorRegistry (several routers can live in one test process). Per-worker
gauges and the hit-rate gauges are refreshed from live state when /metrics is scraped, so they are
exact at scrape time without bookkeeping on every request.

The predicted hit rate is the tree's forecast (matched characters / request characters, for the
worker that answered); the real one is what the engines report (cached / prompt tokens). Drift
between the two means the tree's bound or the engines' caches should be looked at.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "radixray_router:"
# /metrics answers in the classic text format, whatever the client asks: prometheus-client
# answers an OpenMetrics Accept header (which Prometheus sends by default) with the colon in
# sample names turned into an underscore while HELP/TYPE keep it (prometheus/client_python issue
# 1177). The replicas' /metrics uses this too.
EXPOSITION_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(f"{p}requests_total", "Requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.errors = Counter(f"{p}errors_total", "Failed attempts against a worker, by kind "
                              "(connect, timeout, http_<status>, stream, protocol)",
                              ["worker", "kind"], registry=r)
        self.retries = Counter(f"{p}retries_total", "Retries, labelled with the worker the "
                               "failed attempt went to", ["worker"], registry=r)
        self.decisions = Counter(f"{p}policy_decisions_total", "Routing decisions",
                                 ["policy", "decision"], registry=r)
        self.predicted_cached_chars = Counter(f"{p}predicted_cached_chars_total",
                                              "Request characters the tree predicted cached",
                                              registry=r)
        self.request_chars = Counter(f"{p}request_chars_total",
                                     "Characters of routed requests", registry=r)
        self.real_cached_tokens = Counter(f"{p}real_cached_tokens_total",
                                          "Cached prompt tokens reported by workers", registry=r)
        self.real_prompt_tokens = Counter(f"{p}real_prompt_tokens_total",
                                          "Prompt tokens reported by workers", registry=r)
        self.worker_load = Gauge(f"{p}worker_load", "Requests in flight per worker",
                                 ["worker"], registry=r)
        self.worker_healthy = Gauge(f"{p}worker_healthy",
                                    "1 if the worker passes its health checks",
                                    ["worker"], registry=r)
        self.circuit_state = Gauge(f"{p}circuit_state", "0 closed, 1 open, 2 half-open",
                                   ["worker"], registry=r)
        self.tree_size = Gauge(f"{p}tree_size_chars", "Characters the tree holds per worker",
                               ["worker"], registry=r)
        self.predicted_hit_rate = Gauge(f"{p}predicted_cache_hit_rate",
                                        "predicted_cached_chars_total / request_chars_total",
                                        registry=r)
        self.real_hit_rate = Gauge(f"{p}real_cache_hit_rate",
                                   "real_cached_tokens_total / real_prompt_tokens_total",
                                   registry=r)
        self.duration = Histogram(f"{p}request_duration_seconds",
                                  "Time from request to the last byte of the answer", ["route"],
                                  buckets=DURATION_BUCKETS, registry=r)
        # Plain totals for the hit-rate gauges (reading them back from Counters is clumsy).
        self._pred = [0, 0]  # predicted cached chars, request chars
        self._real = [0, 0]  # cached tokens, prompt tokens

    def record_prediction(self, cached_chars: int, request_chars: int) -> None:
        self.predicted_cached_chars.inc(cached_chars)
        self.request_chars.inc(request_chars)
        self._pred[0] += cached_chars
        self._pred[1] += request_chars

    def record_real(self, cached_tokens: int, prompt_tokens: int) -> None:
        self.real_cached_tokens.inc(cached_tokens)
        self.real_prompt_tokens.inc(prompt_tokens)
        self._real[0] += cached_tokens
        self._real[1] += prompt_tokens

    def forget_worker(self, url: str) -> None:
        """Drop a removed worker's gauge series (its counters stay, as counters should)."""
        for gauge in (self.worker_load, self.worker_healthy, self.circuit_state, self.tree_size):
            try:
                gauge.remove(url)
            except KeyError:
                pass

    def render(self, workers, tree) -> bytes:
        """Refresh gauges from live state, then the text exposition format."""
        for w in workers:
            self.worker_load.labels(w.url).set(w.load)
            self.worker_healthy.labels(w.url).set(1 if w.healthy else 0)
            self.circuit_state.labels(w.url).set(w.breaker.state)
            self.tree_size.labels(w.url).set(tree.size(w.url))
        if self._pred[1]:
            self.predicted_hit_rate.set(self._pred[0] / self._pred[1])
        if self._real[1]:
            self.real_hit_rate.set(self._real[0] / self._real[1])
        return generate_latest(self.registry)
