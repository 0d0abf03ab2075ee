"""random: each request to a worker drawn uniformly."""

from __future__ import annotations

import random
from collections.abc import Sequence

from baton.server.router.policies.base import Candidate, Choice


class RandomChoice:
    name = "random"
    needs_tokens = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, workers: Sequence[Candidate], prompt: Sequence[int] | None) -> Choice:
        return Choice(self.rng.choice(workers), 0)

    def forget(self, worker: Candidate) -> None:
        pass  # keeps nothing per worker
