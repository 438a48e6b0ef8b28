"""Overlap scheduling: build and submit batch N+1 while batch N runs.

``advance`` moves every request's lengths on as soon as its batch is submitted, so batch N+1
can be built and submitted while batch N still runs; its decode inputs whose tokens N has not
returned yet are future references (``batch.decode_input_ids``) that the worker resolves. N's
results are processed while N+1 runs. A request N finishes has one wasted step in N+1, which
is skipped when its results come. Decodes and prefills of waiting requests overlap; what needs
N's results first waits for it (``can_overlap``).

The scheduler picks it at construction when the runner has ``submit``/``result``;
``disable_overlap_schedule`` True/False forces it off/on, unset leaves it to the runner's
``overlap_by_default`` (off for an in-process CPU runner, whose forward competes with the
scheduler for the cores and the GIL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .decode import decode_slots_needed

if TYPE_CHECKING:
    from .batch import ScheduleBatch
    from .scheduler import Scheduler


class OverlapLoop:
    """The overlapped ``step`` of a ``Scheduler``; owns the batch in flight."""

    def __init__(self, sched: "Scheduler"):
        self.sched = sched
        self.inflight: tuple["ScheduleBatch", object] | None = None  # (batch, runner handle)

    def step(self) -> None:
        """Schedule and submit the next batch, then process the previous one's results.
        Mutates the scheduler as ``schedule``/``advance``/``process_output`` do."""
        sched = self.sched
        sched.merge_last_prefill()
        if self.inflight is not None and not self.can_overlap():
            self.finish()
        batch = sched.schedule()
        handle = None
        if batch is not None:
            sched.advance(batch)
            handle = sched.runner.submit(batch.forward_batch)
        self.finish()  # the previous batch, while this one runs
        self.inflight = (batch, handle) if batch is not None else None
        if not sched.live:  # everyone finished: what is in flight is wasted work; wait it out
            self.finish()

    def can_overlap(self) -> bool:
        """True when the next batch, whatever ``schedule`` makes of it (a prefill of waiting
        requests, a decode of the running set, or both mixed), needs neither the in-flight
        tokens' values on this side (penalties and grammar masks do) nor a retraction (it
        would reset a request whose results are still coming), and no prompt is mid-chunk.
        Waiting requests also wait when the batch in flight computes prompts: those enter the
        radix tree when its results are processed, and a waiting request may share them; and
        so do requests waiting for a host-tier load the batch in flight carries (taking its
        results first lets them run in the next batch, not the one after)."""
        sched = self.sched
        batch = self.inflight[0] if self.inflight is not None else None
        inflight_prefill = batch is not None and bool(batch.prefill)
        inflight_loads = batch is not None and batch.copies is not None and bool(
            batch.copies.loads)
        return (sched.chunked_req is None and not (sched.waiting and inflight_prefill)
                and not (sched.loading and inflight_loads)
                and not any(r.sampling_params.has_penalties or r.grammar is not None
                            for r in sched.running)
                and decode_slots_needed(sched.running, sched.cache)
                <= sched.cache.available_and_evictable())

    def finish(self) -> None:
        """Wait for the batch in flight, if any, and process its results."""
        if self.inflight is not None:
            batch, handle = self.inflight
            self.inflight = None
            self.sched.process_output(batch, self.sched.runner.result(handle))
