"""A circuit breaker per worker: a worker that keeps failing requests is left alone a while,
then tried with one request.

    closed ──(failure_threshold failures in a row)──> open ──(open_s passed)──> half-open
      ^                                               ^                            │
      └───────────── the trial request succeeds ──────┼──── it fails ──────────────┘

Health probes catch a worker that is gone; the circuit catches one that answers `/health` but
fails the requests themselves (a handover path that is broken, an engine that refuses all). Only
failures that are the worker's (refused, reset, 503, a failed handover) count, never a client's
400. While half-open the worker takes one request at a time: the trial. A circuit only ever moves
requests to other workers: when every worker of a role is open, they are all tried anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

CircuitState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, kw_only=True)
class CircuitSettings:
    failure_threshold: int  # failures in a row that open the circuit
    open_s: float  # how long it stays open before a trial request


@dataclass
class Circuit:
    settings: CircuitSettings
    failures: int = 0  # in a row
    opened_at: float | None = None  # monotonic time it opened; None while closed
    trial_running: bool = False  # half-open: the one request let through is in flight

    def state(self, now: float | None = None) -> CircuitState:
        if self.opened_at is None:
            return "closed"
        now = time.monotonic() if now is None else now
        return "open" if now - self.opened_at < self.settings.open_s else "half_open"

    def allows(self, now: float | None = None) -> bool:
        """Whether the worker may get a new request now."""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self.trial_running)

    def started(self) -> None:
        if self.state() == "half_open":
            self.trial_running = True

    def ended(self) -> None:
        """A request on the worker ended, whatever its outcome (a trial that ended neither way,
        the client left, say, lets the next request be the trial)."""
        self.trial_running = False

    def succeeded(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.trial_running = False

    def failed(self, now: float | None = None) -> bool:
        """Count a failure; True when it opened (or reopened) the circuit."""
        now = time.monotonic() if now is None else now
        self.failures += 1
        was = self.state(now)
        if was == "half_open" or (
            was == "closed" and self.failures >= self.settings.failure_threshold
        ):
            self.opened_at = now
            self.trial_running = False
            return True
        return False
