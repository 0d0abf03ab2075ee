"""The model-free drafter: prompt lookup (vLLM's "ngram" method), for every family.

The longest suffix of the sequence, between `prompt_lookup_min` and `prompt_lookup_max` tokens,
that also occurs earlier is looked up; the k tokens that followed its latest earlier occurrence
are the drafts (the latest: text that repeats tends to repeat what it said last). A match too
close to the end to supply k tokens is topped up with its last token: a verify row always feeds
k + 1 tokens, and a draft that is wrong costs nothing but its row.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> tuple[int, ...]:
    """k drafted continuations of `token_ids`, or () when no suffix of the lengths recurs."""
    ids = np.asarray(token_ids, dtype=np.int64)
    n_tokens = len(ids)
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        suffix = ids[n_tokens - n :]
        # windows starting before the suffix itself: each is followed by at least one token
        windows = sliding_window_view(ids[: n_tokens - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = ids[starts[-1] + n : starts[-1] + n + k].tolist()
            return tuple(follow + [follow[-1]] * (k - len(follow)))
    return ()


class NgramDrafter:
    def __init__(self, k: int, lookup_min: int, lookup_max: int):
        self.k = k
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int]) -> tuple[int, ...]:
        return ngram_drafts(token_ids, self.k, self.lookup_min, self.lookup_max)
