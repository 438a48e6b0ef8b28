"""Admission control: at most N requests in flight, a bounded queue behind them, 429 beyond.

Waiting in the router (rather than in one engine's queue) keeps a queued request free to go to
whichever worker frees up first. Slots are handed over in arrival order (asyncio.Semaphore is
FIFO for waiters).
"""

from __future__ import annotations

import asyncio


class Rejected(Exception):
    """No slot and no room (or no more patience) in the queue: the client should back off."""


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout: float):
        self.limited = max_concurrent > 0
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self._sem = asyncio.Semaphore(max_concurrent) if self.limited else None
        self.waiting = 0
        self.active = 0

    async def acquire(self) -> bool:
        """Take a slot, waiting in the queue if needed; raises Rejected when full or timed out.
        Returns True (so that a caller cancelling it can tell a slot taken from none)."""
        if self.limited:
            if self._sem.locked():
                if self.waiting >= self.queue_size:
                    raise Rejected(f"router at capacity: {self.max_concurrent} requests in "
                                   f"flight and {self.waiting} queued")
                self.waiting += 1
                try:
                    await asyncio.wait_for(self._sem.acquire(), self.queue_timeout)
                except asyncio.TimeoutError:
                    raise Rejected(f"router at capacity: waited {self.queue_timeout:g} s in "
                                   f"the queue") from None
                finally:
                    self.waiting -= 1
            else:
                await self._sem.acquire()
        self.active += 1
        return True

    def release(self) -> None:
        """Give the slot back (exactly once per successful acquire)."""
        self.active -= 1
        if self.limited:
            self._sem.release()
