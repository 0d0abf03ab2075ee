"""The router's record of what one worker caches: whole Mamba checkpoint blocks, LRU.

A hybrid worker's prefix cache (engine/cache/prefix_cache.py) is a chain of blocks of exactly
`track_interval` tokens (whole KV pages), each ending at a Mamba checkpoint. A prompt is
reusable only up to a block boundary and never to its last token (its logits are needed):

    prompt (len 300), track_interval 64:
        [ 0..63 ][ 64..127 ][ 128..191 ][ 192..255 ][ 256..299 ]
           b0        b1         b2          b3        no checkpoint
    usable at most (300 - 1) // 64 = 4 blocks = 256 tokens, if the worker holds b0..b3.

A K/V match of 250 tokens is worth 192 here: the state at 250 is not saved anywhere. So the router
keeps, per worker, the chained keys of the blocks it sent there (key k = hash(key k-1, tokens of
block k): a key names its whole prefix, as a radix tree's path does), and matches a prompt
block by block, in the worker's own interval. Workers with other intervals hold other blocks.

Capacity is a count of blocks; past it the least recently used go first, deepest first (the
engine evicts leaves first too). Overestimating what a worker holds costs little for chats:
the conversation goes back to the worker that served its last turn, which no other worker could
serve better; underestimating loses hits. So the default capacity is generous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_chain(prompt: Sequence[int], track_interval: int) -> list[int]:
    """Chained keys of the prompt's whole blocks of `track_interval` tokens."""
    keys, key = [], 0
    for start in range(0, len(prompt) - track_interval + 1, track_interval):
        key = hash((key, tuple(prompt[start : start + track_interval])))
        keys.append(key)
    return keys


class PrefixBlocks:
    """The blocks the router believes one worker holds."""

    def __init__(self, track_interval: int, capacity: int) -> None:
        self.track_interval = track_interval
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._keys)

    def usable_tokens(self, prompt_len: int, chain: list[int]) -> int:
        """Tokens of a prompt of `prompt_len` (block keys `chain`) the worker could reuse: its
        held blocks from the start, leaving at least one token to compute."""
        limit = (prompt_len - 1) // self.track_interval
        held = 0
        for key in chain[:limit]:
            if key not in self._keys:
                break
            held += 1
        return held * self.track_interval

    def record(self, chain: list[int]) -> None:
        """The worker is about to compute (or reuse) these blocks: most recently used now, the
        deepest block the least recent of them, so that eviction takes leaves first."""
        for key in reversed(chain):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
