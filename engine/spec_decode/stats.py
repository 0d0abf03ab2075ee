"""Speculative decoding's counters, named as vLLM names them (`spec_decode_num_drafts`, ...):
the server exports them under baton's prefix and derives the mean acceptance length, 1 +
accepted / drafts (tokens a verify step appends per request)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from baton.engine.spec_decode.verifier import Verified


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0  # verify rows run
    num_draft_tokens: int = 0  # drafted tokens verified
    num_accepted_tokens: int = 0  # of them accepted
    # accepted_per_pos[i]: verify rows that accepted their draft at position i
    accepted_per_pos: list[int] = field(default_factory=list)

    def count(self, verified: Iterable[Verified]) -> None:
        for v in verified:
            self.num_drafts += 1
            self.num_draft_tokens += v.drafts
            self.num_accepted_tokens += v.accepted
            if len(self.accepted_per_pos) < v.drafts:
                self.accepted_per_pos.extend([0] * (v.drafts - len(self.accepted_per_pos)))
            for i in range(v.accepted):
                self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step appended per request on average (1 + accepted drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
