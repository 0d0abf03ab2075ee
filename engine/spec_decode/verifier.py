"""Sampling a step, and for speculative verify rows, acceptance.

A verify sequence fed its last token t and k drafts d_1..d_k, and got logits at each of the
k + 1 positions. Every position is sampled exactly as a plain decode step would sample it there
(penalties, logit bias, min_tokens, grammar masks all see the output extended by the drafts
before it), giving target tokens y_0..y_k. The drafts are accepted while they equal them:

    j = max { i : d_1 = y_0, ..., d_i = y_{i-1} };   the step appends y_0 .. y_j  (j + 1 tokens)

For greedy rows this is the longest matching prefix. For random rows it is rejection sampling
with a one-hot draft distribution (every drafter here proposes one token per position): draft d
is accepted with probability p(d), and on rejection the token emitted is the target's sample
conditioned on differing from d, i.e. drawn from the residual max(0, p - q) renormalised —
exactly the standard speculative-sampling rule, so the output distribution is the target's.
It is computed in its coupled form: y_i is the Gumbel-max sample the sampler draws from its
noise anyway, so a seeded request's noise stream can be rewound to the draws of the tokens it
kept, and it samples the very tokens it would without speculation (tests/test_spec_sampling.py
checks the distribution and the seeded identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from baton.engine.core.outputs import SampledTokens
from baton.engine.core.request import Request
from baton.engine.core.sampler import Sampler
from baton.engine.executor.forward_metadata import ScheduledBatch
from baton.engine.structured_output.grammars import Grammars


class DraftedRow:
    """A request as the sampler sees it at one verify position: its output extended by the
    drafts before that position. It reads what the sampler reads of a Request and shares the
    request's cached logit-bias tensors."""

    __slots__ = ("req", "pending")

    def __init__(self, req: Request, pending: tuple[int, ...]):
        self.req = req
        self.pending = pending

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def params(self):
        return self.req.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.req.generator

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids + list(self.pending)

    @property
    def all_ids(self) -> list[int]:
        return self.req.all_ids + list(self.pending)

    @property
    def logit_bias_rows(self):
        return self.req.logit_bias_rows

    @logit_bias_rows.setter
    def logit_bias_rows(self, rows) -> None:
        self.req.logit_bias_rows = rows


class Verified(NamedTuple):
    drafts: int  # drafted tokens verified
    accepted: int  # of them accepted (the leading ones)


def sample_step(
    sampler: Sampler,
    grammars: Grammars,
    logits: torch.Tensor,
    sched: ScheduledBatch,
    reqs: Sequence[Request],
    rows_of: dict[int, list[int]],
    eos_ids: tuple[int, ...],
    vocab_size: int,
) -> tuple[dict[int, SampledTokens], list[Verified]]:
    """Sample every sequence in `sched.logits_seqs` (logits: rows of the forward's logits
    indices, `rows_of[s]` those of sequence s); verify sequences are accepted as above.
    Returns the tokens per sequence and, per verify sequence, how many drafts it accepted."""
    nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
    sample_rows: list[int] = []
    contexts: list[Request | DraftedRow] = []
    pending: list[tuple[int, ...]] = []
    for s in sched.logits_seqs:
        req = reqs[s]
        if nd <= s < nd + nv:
            drafts = tuple(req.drafts)
            for i, row in enumerate(rows_of[s]):
                sample_rows.append(row)
                contexts.append(DraftedRow(req, drafts[:i]) if i else req)
                pending.append(drafts[:i])
        else:
            sample_rows.append(rows_of[s][-1])
            contexts.append(req)
            pending.append(())
    if sample_rows != list(range(logits.shape[0])):  # decode-only: skip the copy
        logits = logits[sample_rows]
    # A seeded random verify request draws k + 1 noise rows; it keeps the draws of the tokens
    # it appends (rewound below), as if it had sampled them one step at a time.
    seeded = {
        s: reqs[s].generator.get_state()
        for s in range(nd, nd + nv)
        if reqs[s].generator is not None and not reqs[s].params.greedy
    }
    result = sampler(logits, contexts, eos_ids, grammars.constrain(contexts, pending))
    sampled: dict[int, SampledTokens] = {}
    verified: list[Verified] = []
    row = 0
    for s in sched.logits_seqs:
        if not nd <= s < nd + nv:
            sampled[s] = SampledTokens((result.token_ids[row],), (result.logprobs[row],))
            row += 1
            continue
        drafts = reqs[s].drafts
        targets = result.token_ids[row : row + len(drafts) + 1]
        j = 0
        while j < len(drafts) and targets[j] == drafts[j]:
            j += 1
        sampled[s] = SampledTokens(
            tuple(targets[: j + 1]), tuple(result.logprobs[row : row + j + 1])
        )
        if s in seeded:
            reqs[s].generator.set_state(seeded[s])
            Sampler.skip_seeded_draws(reqs[s], j + 1, vocab_size)
        verified.append(Verified(drafts=len(drafts), accepted=j))
        row += len(drafts) + 1
    return sampled, verified
