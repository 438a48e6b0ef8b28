"""A per-worker circuit breaker: closed -> open -> half-open -> closed.

* closed: traffic flows; failures are remembered for ``window`` seconds, and ``failure_threshold``
  of them within the window open the circuit.
* open: no traffic for ``cooldown`` seconds, then half-open; or half-open at once when a health
  check of the worker passes (``probe_passed``: it answers again, say after a restart, and a
  cool-down would keep a one-replica deployment refusing everything for a minute).
* half-open: one trial request at a time; ``success_threshold`` successes in a row close the
  circuit, any failure opens it again for another cool-down.

What counts as a failure is the caller's choice (the proxy reports connection errors, timeouts
and 5xx answers). The clock is injectable so tests need not sleep.
"""

from __future__ import annotations

import time
from collections import deque

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # also the values of the circuit_state gauge
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 10, window: float = 120.0, cooldown: float = 60.0,
                 success_threshold: int = 3, clock=time.monotonic):
        self.failure_threshold = failure_threshold
        self.window = window
        self.cooldown = cooldown
        self.success_threshold = success_threshold
        self.clock = clock
        self._state = CLOSED
        self._failures: deque[float] = deque()  # failure times within the window (closed state)
        self._opened_at = 0.0
        self._successes = 0  # consecutive successes while half-open
        self._trial_in_flight = False

    @property
    def state(self) -> int:
        """Current state; moves open -> half-open once the cool-down has passed."""
        if self._state == OPEN and self.clock() - self._opened_at >= self.cooldown:
            self._state = HALF_OPEN
            self._successes = 0
            self._trial_in_flight = False
        return self._state

    def probe_passed(self) -> None:
        """A health check of the worker passed: an open circuit goes half-open now, so trial
        requests decide (a worker still failing them re-opens it)."""
        if self.state == OPEN:
            self._state = HALF_OPEN
            self._successes = 0
            self._trial_in_flight = False

    def allows(self) -> bool:
        """Whether a request may be sent now (does not reserve the half-open trial slot)."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._trial_in_flight)

    def on_send(self) -> None:
        """A request is being sent: in half-open this takes the single trial slot."""
        if self.state == HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        """A request succeeded: may close a half-open circuit."""
        state = self.state
        if state == HALF_OPEN:
            self._trial_in_flight = False
            self._successes += 1
            if self._successes >= self.success_threshold:
                self._state = CLOSED
                self._failures.clear()

    def record_failure(self) -> None:
        """A request failed: may open the circuit (or re-open a half-open one)."""
        state, now = self.state, self.clock()
        if state == HALF_OPEN:
            self._open(now)
        elif state == CLOSED:
            self._failures.append(now)
            while self._failures and now - self._failures[0] > self.window:
                self._failures.popleft()
            if len(self._failures) >= self.failure_threshold:
                self._open(now)

    def record_neutral(self) -> None:
        """The request ended without a verdict on the worker (e.g. the client went away)."""
        if self._state == HALF_OPEN:
            self._trial_in_flight = False

    def _open(self, now: float) -> None:
        self._state = OPEN
        self._opened_at = now
        self._failures.clear()
        self._trial_in_flight = False
