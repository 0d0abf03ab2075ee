"""The carrier of one drafter forward (speculative decoding's MTP head).

A draft forward runs the MTP head over rows built like any step's (a ScheduledBatch: the
positions, the tokens AFTER each position, the request's pages; through the one builder), with
the hidden state each row starts from taken from one of three places:

    "target"  the final hidden states of this rank's latest target forward, rows `hidden_rows`
              (the first pass after a step: every position that step made final)
    "draft"   the output of this rank's latest draft forward, rows `hidden_rows` (chained passes)
    "slots"   the hidden state kept in each row's working slot (`batch.mamba_slots`, one row per
              request): a request handed over by a PD prefill worker drafts at once from it

Every tensor-parallel rank holds the same hidden states (the residual stream is replicated),
so rank 0 sends this carrier and each rank gathers its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from baton.engine.executor.forward_metadata import ScheduledBatch

HiddenSource = Literal["target", "draft", "slots"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftBatch:
    batch: ScheduledBatch
    hidden_from: HiddenSource
    hidden_rows: tuple[int, ...]  # (num_tokens,) rows of the source; empty for "slots"
