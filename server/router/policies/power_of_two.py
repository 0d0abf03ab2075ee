"""power_of_two: draw two workers, send the request to the less loaded one.

Load is what the router sees: its own requests in flight on each worker. Two random draws avoid
the herd that "always the least loaded" makes when many routers (or many requests between two
load updates) agree on the same worker, and get most of its benefit (Mitzenmacher's power of two
choices).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from baton.server.router.policies.base import Candidate, Choice


class PowerOfTwo:
    name = "power_of_two"
    needs_tokens = False

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, workers: Sequence[Candidate], prompt: Sequence[int] | None) -> Choice:
        if len(workers) == 1:
            return Choice(workers[0], 0)
        first, second = self.rng.sample(list(workers), 2)
        return Choice(first if first.load <= second.load else second, 0)

    def forget(self, worker: Candidate) -> None:
        pass  # keeps nothing per worker
