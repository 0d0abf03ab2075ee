"""Routing policies: which worker of one role (prefill or decode) serves a request.

One small file per policy behind one interface (as SGLang's model gateway keeps its `policies/`):
the router gives a policy the workers it may use now (healthy, not draining, circuit closed; never
empty) and the prompt's token ids when some policy needs them, and gets back a `Choice`. The two
roles have a policy each (`--prefill-policy`, `--decode-policy`), so a pick on one side never
depends on the other.

    round_robin   in turn
    random        uniformly at random
    power_of_two  the less loaded of two drawn at random (load: the router's requests in flight)
    cache_aware   the worker holding the longest usable prefix, unless the load is too uneven
                  (cache_aware.py; what a worker holds is the router's own record, prefix_blocks.py)
"""

from __future__ import annotations

import random

from baton.server.router.policies.base import Policy
from baton.server.router.policies.cache_aware import CacheAware, CacheAwareSettings
from baton.server.router.policies.power_of_two import PowerOfTwo
from baton.server.router.policies.random_choice import RandomChoice
from baton.server.router.policies.round_robin import RoundRobin

POLICY_NAMES = ("round_robin", "random", "power_of_two", "cache_aware")


def make_policy(name: str, cache_aware: CacheAwareSettings, rng: random.Random) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "cache_aware":
        return CacheAware(cache_aware)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
