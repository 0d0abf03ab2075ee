"""round_robin: each request to the next worker in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from baton.server.router.policies.base import Candidate, Choice


class RoundRobin:
    name = "round_robin"
    needs_tokens = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, workers: Sequence[Candidate], prompt: Sequence[int] | None) -> Choice:
        return Choice(workers[next(self._turn) % len(workers)], 0)

    def forget(self, worker: Candidate) -> None:
        pass  # keeps nothing per worker
