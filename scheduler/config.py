"""The scheduler's arguments, with SGLang's names and defaults, checked once at construction.

``SchedulerConfig`` is frozen: one scheduler reads it for its whole life. Every invalid value
raises ``ValueError`` whose message starts with the argument's name, so the Engine and the
command line can report it as given.
"""

from __future__ import annotations

import math
import random

from dataclasses import dataclass, fields

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority", "routing-key")
EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "fifo", "filo", "mru")
WRITE_POLICIES = ("write_through", "write_back")  # hierarchical cache


@dataclass(frozen=True)
class SchedulerConfig:
    schedule_policy: str = "fcfs"
    # lpm, dfs-weight, lof, routing-key: a request waiting longer than this (seconds) goes
    # first, oldest first, so none waits for ever behind a stream of others; 0: never (SGLang).
    schedule_max_wait: float = 10.0
    # Scales the decode-token reservation (new_token_ratio): > 1 admits fewer requests at once
    # and retracts less; < 1 admits more and retracts more.
    schedule_conservativeness: float = 1.0
    # Longest prefill piece per step; None or -1 turns chunked prefill off. SGLang picks it
    # from GPU memory (2048 .. 16384); CPU pools are small, so take the small GPUs' value.
    chunked_prefill_size: int | None = 2048
    max_prefill_tokens: int = 16384
    # KV pool size and running-request cap; None: the model runner sizes them from memory.
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    page_size: int = 1
    radix_eviction_policy: str = "lru"
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    # Check the memory invariant after every step (slow; for tests and debugging).
    debug_invariants: bool = False
    # Overlap scheduling: build and submit batch N+1 while batch N runs (see scheduler.py).
    # None: on when the runner computes beside the scheduler (worker processes, a GPU), off
    # for an in-process CPU runner, whose forward competes for the scheduler's cores and GIL
    # (measured 0.7x in bench/shared_prefix.py); True/False turn it off/on regardless.
    disable_overlap_schedule: bool | None = None
    # Seeds unseeded sampling and the `random` queue policy; None: one drawn at construction
    # (as SGLang), so fresh starts do not repeat each other's samples.
    random_seed: int | None = None
    # Constrained decoding (constrained.py): skip decode steps for text the grammar forces,
    # and give up on a grammar whose compilation takes longer than this (seconds).
    disable_jump_forward: bool = False
    grammar_compile_timeout: float = 30.0
    # Hierarchical cache (hicache.py): a host-memory tier under the radix tree. The host pool
    # holds hicache_ratio x the device pool's tokens, or hicache_size GB per rank when > 0.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"  # or write_back: copy on device eviction

    def __post_init__(self):
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg} (got {getattr(self, name)!r})")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(is_int(self.page_size) and self.page_size >= 1, "page_size",
              "must be a positive integer")
        check(self.schedule_policy in SCHEDULE_POLICIES, "schedule_policy",
              f"must be one of {', '.join(SCHEDULE_POLICIES)}")
        check(isinstance(self.schedule_conservativeness, (int, float))
              and not isinstance(self.schedule_conservativeness, bool)
              and self.schedule_conservativeness > 0, "schedule_conservativeness",
              "must be a positive number")
        check(self.chunked_prefill_size is None or (is_int(self.chunked_prefill_size) and (
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size)),
              "chunked_prefill_size", "must be -1 (off) or an integer >= page_size")
        check(is_int(self.max_prefill_tokens) and self.max_prefill_tokens > 0,
              "max_prefill_tokens", "must be a positive integer")
        for name in ("max_total_tokens", "max_running_requests"):
            value = getattr(self, name)
            check(value is None or (is_int(value) and value > 0), name,
                  "must be a positive integer")
        check(self.radix_eviction_policy in EVICTION_POLICIES, "radix_eviction_policy",
              f"must be one of {', '.join(EVICTION_POLICIES)}")
        for name in ("disable_radix_cache", "enable_mixed_chunk", "debug_invariants",
                     "disable_jump_forward"):
            check(isinstance(getattr(self, name), bool), name, "must be true or false")
        check(self.disable_overlap_schedule is None
              or isinstance(self.disable_overlap_schedule, bool), "disable_overlap_schedule",
              "must be true, false or unset")
        if self.random_seed is None:
            object.__setattr__(self, "random_seed", random.randrange(1 << 30))
        check(is_int(self.random_seed), "random_seed", "must be an integer")
        check(isinstance(self.schedule_max_wait, (int, float))
              and not isinstance(self.schedule_max_wait, bool)
              and 0 <= self.schedule_max_wait < math.inf, "schedule_max_wait",
              "must be a number of seconds >= 0 (0: never)")
        check(isinstance(self.grammar_compile_timeout, (int, float))
              and not isinstance(self.grammar_compile_timeout, bool)
              and self.grammar_compile_timeout > 0, "grammar_compile_timeout",
              "must be a positive number of seconds")
        check(isinstance(self.enable_hierarchical_cache, bool), "enable_hierarchical_cache",
              "must be true or false")
        check(not (self.enable_hierarchical_cache and self.disable_radix_cache),
              "enable_hierarchical_cache", "needs the radix cache: it cannot be used with "
              "disable_radix_cache (the host tier holds the tree's evicted prefixes)")
        for name in ("hicache_ratio", "hicache_size"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and 0 <= value < math.inf, name, "must be a finite number >= 0")
        check(self.hicache_write_policy in WRITE_POLICIES, "hicache_write_policy",
              f"must be one of {', '.join(WRITE_POLICIES)}")

    @property
    def chunk_size(self) -> int | None:
        """The chunked-prefill budget per step, or None when chunking is off."""
        size = self.chunked_prefill_size
        return None if size is None or size == -1 else size

    @classmethod
    def field_defaults(cls) -> dict:
        """Each argument's declared default (None where one is drawn or sized at start)."""
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
