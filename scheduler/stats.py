"""The scheduler's counters, and what it exports as metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler


@dataclass
class SchedulerStats:
    """Running totals since start (tests and the benchmark read them; ``metrics()`` exports)."""

    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    num_mixed_batches: int = 0
    num_copy_batches: int = 0  # batches of hierarchical-cache copies only (no request)
    prefill_tokens: int = 0  # prompt tokens computed (chunks and re-prefills included)
    decode_tokens: int = 0
    num_retracted: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0  # of finished requests
    cached_tokens: int = 0  # of finished requests
    host_cached_tokens: int = 0  # of cached_tokens, those loaded from the host tier
    generated_tokens: int = 0

    def count_finished(self, req) -> None:
        """Count a finished request, unless it is a health probe (``Req.probe``)."""
        if req.probe:
            return
        self.num_finished += 1
        self.num_aborted += req.finish_reason.type == "abort"
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_tokens
        self.host_cached_tokens += req.host_cached_tokens


def scheduler_metrics(sched: "Scheduler") -> dict:
    """A scheduler's gauges and cumulative counters, named as cluster/metrics.py expects them."""
    pool, s, hi = sched.cache.pool_size, sched.stats, sched.cache.hicache
    used = pool - sched.cache.available_and_evictable()
    return {
        "num_running_reqs": len(sched.running) + (sched.chunked_req is not None),
        "num_queue_reqs": len(sched.waiting) + len(sched.loading),
        "num_grammar_queue_reqs": len(sched.grammars.queue) if sched.grammars else 0,
        "token_usage": used / pool,
        "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        "new_token_ratio": sched.ratio.value,
        "kv_available_tokens": sched.cache.available_size(),
        "kv_evictable_tokens": sched.cache.evictable_size(),
        "prompt_tokens_total": s.prompt_tokens,
        "generation_tokens_total": s.generated_tokens,
        "cached_tokens_total": s.cached_tokens,
        "host_cached_tokens_total": s.host_cached_tokens,
        "num_requests_total": s.num_finished,
        "num_aborted_requests_total": s.num_aborted,
        "num_retracted_reqs_total": s.num_retracted,
        "evicted_tokens_total": sched.cache.evicted_tokens + (hi.stats.load_evicted
                                                               if hi is not None else 0),
        "hicache_copy_failures_total": hi.stats.failed_batches if hi is not None else 0,
    }
