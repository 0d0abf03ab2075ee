"""The drafters as the engine's step sees them: after sampling (before the scheduler takes the
step's tokens), `propose` returns the k drafts each continuing request verifies next step;
`propose_from_slots` drafts for requests handed over by a PD prefill worker, before their first
step, from the state that came with them.

    NgramDrafter (engine/spec_decode/ngram.py)   host only: prompt lookup over the tokens
    MtpDrafter   (engine/spec_decode/mtp.py)     the checkpoint's MTP head through the runner
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from baton.engine.core.outputs import SampledTokens
from baton.engine.core.request import Request
from baton.engine.executor.forward_metadata import ScheduledBatch
from baton.engine.spec_decode.config import SpeculativeConfig
from baton.engine.spec_decode.ngram import ngram_drafts

Drafts = dict[int, tuple[int, ...]]  # seq index in the step -> its drafts


class Drafter(Protocol):
    def propose(
        self, sched: ScheduledBatch, reqs: Sequence[Request], sampled: dict[int, SampledTokens]
    ) -> Drafts: ...

    def propose_from_slots(self, reqs: Sequence[Request]) -> list[tuple[int, ...]]: ...


def drafts_wanted(req: Request, new_tokens: int, k: int, max_model_len: int) -> bool:
    """Whether drafting for `req` can pay off after it appends `new_tokens`: it may produce
    more than one more token, and the drafted positions (the MTP chain's and the verify's)
    stay well inside the context."""
    produced = len(req.output_ids) + new_tokens
    return (
        req.params.max_tokens - produced > 1
        and req.num_tokens + new_tokens + 2 * k <= max_model_len
    )


class NgramStepDrafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def _draft(self, token_ids: list[int]) -> tuple[int, ...]:
        c = self.config
        return ngram_drafts(
            token_ids, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max
        )

    def propose(
        self, sched: ScheduledBatch, reqs: Sequence[Request], sampled: dict[int, SampledTokens]
    ) -> Drafts:
        k = self.config.num_speculative_tokens
        drafts = {}
        for s, tokens in sampled.items():
            req = reqs[s]
            if drafts_wanted(req, len(tokens.token_ids), k, self.max_model_len):
                proposal = self._draft(req.all_ids + list(tokens.token_ids))
                if proposal:
                    drafts[s] = proposal
        return drafts

    def propose_from_slots(self, reqs: Sequence[Request]) -> list[tuple[int, ...]]:
        return [self._draft(req.all_ids) for req in reqs]
