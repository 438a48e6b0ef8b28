"""The scheduler's counters."""

from __future__ import annotations

from dataclasses import dataclass


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
