"""cache_aware: send a request where its longest usable prefix is cached, unless the load is
too uneven (SGLang's model gateway's approximate-tree policy, in Mamba checkpoint blocks).

How the router learns what a worker holds: from its own record of what it routed there
(prefix_blocks.py), not from events the workers publish (vLLM / Dynamo KV events). Why:

* The record needs nothing from a worker but its page size and track interval, read once from
  `/disagg/info`; no second channel per worker (a ZMQ subscription with sequence numbers, replay
  after a reconnect, a snapshot for a router that starts late), no coupling to how the engine
  stores and evicts blocks, which is changing.
* A wrong guess costs a recompute, never a wrong answer: the worker's own cache decides what is
  reused. The router's guess is only where to look.
* Hybrid block geometry is where event-fed routers go wrong (Dynamo's router compares hashes of
  K/V blocks whose size differs from the worker's checkpoint interval, dynamo #9376); here the
  router hashes the prompt in each worker's own interval, so a match is a usable one.
* What it misses: evictions under memory pressure (the record ages out by LRU and a capacity),
  a worker restarted between two probes (its record is dropped when a probe finds it gone), and
  other routers' traffic (run one router, or give a conversation's requests the same router).

Picking, per role, among the workers the router may use:

    loads imbalanced: max - min > --balance-abs-threshold and max > min * --balance-rel-threshold
        -> the least loaded worker
    else the worker with the most usable prefix tokens (ties: the less loaded);
        if that is not more than --cache-threshold of the prompt, the worker whose record is
        smallest (the most room for a new prefix; ties: the less loaded)

and the chosen worker's record gets the prompt's blocks (it will compute or reuse them), so the
next turn of a conversation, which extends this prompt, finds them there. Decode workers cache
the prompts handed to them too, so the decode pick reads the decode workers' records the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.server.router.policies.base import Candidate, Choice
from baton.server.router.policies.prefix_blocks import PrefixBlocks, block_chain


@dataclass(frozen=True, kw_only=True)
class CacheAwareSettings:
    cache_threshold: float  # fraction of the prompt a match must pass to decide the pick
    balance_abs_threshold: int  # requests in flight: max - min above this ...
    balance_rel_threshold: float  # ... and max above min times this: balance the load instead
    max_tree_size: int  # blocks remembered per worker


class CacheAware:
    name = "cache_aware"
    needs_tokens = True

    def __init__(self, settings: CacheAwareSettings) -> None:
        self.settings = settings
        self.records: dict[str, PrefixBlocks] = {}  # worker url -> what it is believed to hold

    def pick(self, workers: Sequence[Candidate], prompt: Sequence[int] | None) -> Choice:
        prompt = prompt or ()
        chains: dict[int, list[int]] = {}  # track interval -> the prompt's block keys

        def usable(worker: Candidate) -> int:
            record = self._record(worker)
            if record is None or not prompt:
                return 0
            chain = chains.setdefault(
                record.track_interval, block_chain(prompt, record.track_interval)
            )
            return record.usable_tokens(len(prompt), chain)

        cached = {worker.url: usable(worker) for worker in workers}
        if self._imbalanced([worker.load for worker in workers]):
            chosen = min(workers, key=lambda w: w.load)
        else:
            chosen = max(workers, key=lambda w: (cached[w.url], -w.load))
            if cached[chosen.url] <= self.settings.cache_threshold * len(prompt):
                chosen = min(workers, key=lambda w: (self._size(w), w.load))
        record = self._record(chosen)
        if record is not None and prompt:
            record.record(
                chains.get(record.track_interval) or block_chain(prompt, record.track_interval)
            )
        return Choice(chosen, cached[chosen.url])

    def forget(self, worker: Candidate) -> None:
        self.records.pop(worker.url, None)

    def _imbalanced(self, loads: list[int]) -> bool:
        low, high = min(loads), max(loads)
        settings = self.settings
        return (
            high - low > settings.balance_abs_threshold
            and high > low * settings.balance_rel_threshold
        )

    def _record(self, worker: Candidate) -> PrefixBlocks | None:
        """The worker's record (None when it caches nothing: no prefix cache)."""
        if worker.track_interval <= 0:
            return None
        record = self.records.get(worker.url)
        if record is None or record.track_interval != worker.track_interval:
            record = PrefixBlocks(worker.track_interval, self.settings.max_tree_size)
            self.records[worker.url] = record
        return record

    def _size(self, worker: Candidate) -> int:
        record = self.records.get(worker.url)
        return len(record) if record is not None else 0
