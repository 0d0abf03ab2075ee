"""The model-free drafter: prompt lookup (vLLM's "ngram" method), for every family.

The longest suffix of the sequence, between `prompt_lookup_min` and `prompt_lookup_max` tokens,
that also occurs earlier is looked up; the k tokens that followed its latest earlier occurrence
are the drafts (the latest: text that repeats tends to repeat what it said last). A match too
close to the end to supply k tokens is topped up with its last token: a verify row always feeds
k + 1 tokens, and a draft that is wrong costs nothing but its row.
"""

from __future__ import annotations

import numpy as np


def ngram_drafts(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> tuple[int, ...]:
    """k drafted continuations of `token_ids`, or () when no suffix of the lengths recurs."""
    ids = np.asarray(token_ids, dtype=np.int64)
    last = len(ids) - 1
    if last < lookup_min:
        return ()
    # Earlier positions holding the last token; each grows its match backwards while the tokens
    # before it equal those before the end (one vectorised compare per step back).
    ends = np.flatnonzero(ids[:last] == ids[last])
    length = 1
    while ends.size and length < lookup_max:
        longer = ends[(ends >= length) & (ids[np.maximum(ends - length, 0)] == ids[last - length])]
        if longer.size == 0:
            break
        ends, length = longer, length + 1
    if length < lookup_min or ends.size == 0:
        return ()
    follow = ids[ends[-1] + 1 : ends[-1] + 1 + k].tolist()
    return tuple(follow + [follow[-1]] * (k - len(follow)))


class NgramDrafter:
    def __init__(self, k: int, lookup_min: int, lookup_max: int):
        self.k = k
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int]) -> tuple[int, ...]:
        return ngram_drafts(token_ids, self.k, self.lookup_min, self.lookup_max)
