"""A per-worker circuit breaker: closed -> open -> half-open -> closed.

* closed: traffic flows; failures are remembered for ``window`` seconds, and ``failure_threshold``
  of them within the window open the circuit.
* open: no traffic for ``cooldown`` seconds, then half-open; or half-open at once when a health
  check of the worker passes (``probe_passed``: it answers again, say after a restart, and a
  cool-down would keep a one-replica deployment refusing everything for a minute).
* half-open: traffic flows again, as in SGLang's model gateway; ``success_threshold`` successes
  in a row (requests, or passing health checks) close the circuit, any failure opens it again
  for another cool-down.

Why half-open admits every request rather than one trial at a time: with one trial slot, a
one-replica deployment answered all but one concurrent request with an immediate 503 for as
long as the trial ran (a long generation: minutes), and every caller that looks for any
available worker (the router's /health, /abort_request) saw none. A worker that still fails
costs little more this way: its first failure re-opens the circuit, and the requests that
failed on it are retried on other workers. Why a passing health check counts as a success but
does not close the circuit by itself: a replica's /health runs a real one-token generation,
strong evidence the engine works, yet the breaker exists for workers that pass health checks
and still fail real requests (flapping ones); closing on every check would restart their
failure count every interval. ``reset`` (closed at once) is for a new engine behind the same
URL, which the registry learns from its cache epoch: the old engine's failures say nothing
about it.

What counts as a failure is the caller's choice (the proxy reports connection errors, timeouts
and 5xx answers, but not a replica saying it is restarting). The clock is injectable so tests
need not sleep.
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

    @property
    def state(self) -> int:
        """Current state; moves open -> half-open once the cool-down has passed."""
        if self._state == OPEN and self.clock() - self._opened_at >= self.cooldown:
            self._half_open()
        return self._state

    def allows(self) -> bool:
        """Whether a request may be sent now: any state but open."""
        return self.state != OPEN

    def cooldown_left(self) -> float:
        """Seconds until an open circuit half-opens by itself (0 if it is not open)."""
        if self.state != OPEN:
            return 0.0
        return max(0.0, self.cooldown - (self.clock() - self._opened_at))

    def probe_passed(self) -> None:
        """A health check of the worker passed: an open circuit goes half-open now; a half-open
        one counts it as a success (so an idle worker's circuit closes too)."""
        state = self.state
        if state == OPEN:
            self._half_open()
        elif state == HALF_OPEN:
            self.record_success()

    def record_success(self) -> None:
        """A request succeeded: may close a half-open circuit."""
        if self.state == HALF_OPEN:
            self._successes += 1
            if self._successes >= self.success_threshold:
                self.reset()

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

    def reset(self) -> None:
        """Closed, with no failures remembered (a new engine behind the worker's URL)."""
        self._state = CLOSED
        self._failures.clear()
        self._successes = 0

    def _half_open(self) -> None:
        self._state = HALF_OPEN
        self._successes = 0

    def _open(self, now: float) -> None:
        self._state = OPEN
        self._opened_at = now
        self._failures.clear()
