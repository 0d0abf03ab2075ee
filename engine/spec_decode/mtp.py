"""The MTP drafter: the checkpoint's multi-token-prediction head, chained for k drafts.

After a step's sampling (before the scheduler takes its tokens, so that a PD prefill worker's
snapshot of a finished prompt holds the MTP K/V of every prompt position):

    pass 1    every position the step fed, with the token after it (the next prompt token, the
              token just sampled, a verify row's accepted drafts) and the target's hidden state
              there: writes the MTP head's K/V at those positions, and at each continuing
              request's last kept position drafts d_1
    pass t    (t = 2..k) one row per drafting request at the next position: d_{t-1} with the
              head's own output hidden state -> d_t

Every pass is a forward through the one metadata builder (engine/executor/draft_batch.py); K/V
written at drafted positions is rewritten by pass 1 of a later step before anything reads it.
Drafts are the head's greedy tokens, as vLLM's MTP proposer draws them. A request handed over
by a PD prefill worker drafts before its first step from its kept hidden state (pass 1 at its
last prompt position, hidden from the slot), so PD + speculation runs as colocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from baton.engine.core.outputs import SampledTokens
from baton.engine.core.request import Request
from baton.engine.executor.draft_batch import DraftBatch, HiddenSource
from baton.engine.executor.forward_metadata import ScheduledBatch
from baton.engine.spec_decode.config import SpeculativeConfig
from baton.engine.spec_decode.drafters import Drafts, drafts_wanted
from baton.kernels.cpu.ops import argmax_rows


class MtpDrafter:
    def __init__(self, config: SpeculativeConfig, runner, max_model_len: int):
        """runner: the engine's model runner (ModelRunner, or RankedRunner at TP > 1)."""
        self.k = config.num_speculative_tokens
        self.runner = runner
        self.max_model_len = max_model_len

    def propose(
        self, sched: ScheduledBatch, reqs: Sequence[Request], sampled: dict[int, SampledTokens]
    ) -> Drafts:
        """Pass 1 feeds the step's own rows again (same positions, pages and segments: its
        layouts are the step's), each with the token after it: a verify row's accepted drafts
        and sampled token, then that token again over its rejected positions (their K/V is
        rewritten before anything reads it)."""
        nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
        after: list[int] = []
        # drafting requests: (seq, request, position of its last kept token, that token's row,
        # its logits row: a verify sequence's logits are all of its rows, as the builder gives)
        drafting = []
        offset = logits_rows = 0
        for s, req in enumerate(reqs):
            n, start = sched.seq_lens[s], sched.start_positions[s]
            fed = sched.input_ids[offset : offset + n]
            verify = nd <= s < nd + nv
            if s in sampled:
                tokens = sampled[s].token_ids
                kept = len(tokens) if verify else n
                after += [*fed[1:kept], *(tokens[-1],) * (n - kept + 1)]
                if drafts_wanted(req, len(tokens), self.k, self.max_model_len):
                    row = logits_rows + (kept - 1 if verify else 0)
                    drafting.append((s, req, start + kept - 1, offset + kept - 1, row))
                    logits_rows += 0 if verify else 1
            else:  # a prefill chunk that is not the prompt's last: the next prompt token
                after += [*fed[1:], req.all_ids[start + n]]
            logits_rows += n if verify else 0
            offset += n
        batch = dataclasses.replace(
            sched,
            input_ids=tuple(after),
            verify_slots=tuple((0,) * len(v) for v in sched.verify_slots),  # nothing kept
            logits_seqs=tuple(d[0] for d in drafting),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=False,
            track_points=(),
        )
        first = self._pass(batch, "target", tuple(range(len(after))))
        if not drafting:
            return {}
        chains = self._chain(
            [(req, position) for _, req, position, _, _ in drafting],
            [first[d[4]] for d in drafting],
            tuple(d[3] for d in drafting),
        )
        return {d[0]: chain for d, chain in zip(drafting, chains)}

    def propose_from_slots(self, reqs: Sequence[Request]) -> list[tuple[int, ...]]:
        """Drafts for requests whose prompt was computed elsewhere: pass 1 at the last prompt
        position, from the hidden state kept in the working slot (the first token is fed)."""
        starts = [req.num_computed - 1 for req in reqs]
        batch = _batch(
            [(req, start, (req.all_ids[start + 1],)) for req, start in zip(reqs, starts)],
            list(range(len(reqs))),
        )
        first = self._pass(batch, "slots", ())
        return self._chain(list(zip(reqs, starts)), first, tuple(range(len(reqs))))

    def _chain(
        self, heads: list[tuple[Request, int]], first: list[int], rows: tuple[int, ...]
    ) -> list[tuple[int, ...]]:
        """Passes 2..k: heads are (request, position of its pass-1 row), `rows` those rows in
        the latest draft output; returns each request's k drafts."""
        drafts = [[token] for token in first]
        for t in range(1, self.k):
            batch = _batch(
                [(req, pos + t, (chain[-1],)) for (req, pos), chain in zip(heads, drafts)],
                list(range(len(heads))),
            )
            for chain, token in zip(drafts, self._pass(batch, "draft", rows)):
                chain.append(token)
            rows = tuple(range(len(heads)))
        return [tuple(chain) for chain in drafts]

    def _pass(
        self, batch: ScheduledBatch, source: HiddenSource, rows: tuple[int, ...]
    ) -> list[int]:
        logits = self.runner.draft(DraftBatch(batch=batch, hidden_from=source, hidden_rows=rows))
        return argmax_rows(logits).tolist()


def _batch(
    rows: list[tuple[Request, int, tuple[int, ...]]], logits_seqs: list[int]
) -> ScheduledBatch:
    """The MTP rows as a step's batch: (request, first position, the tokens after each of its
    positions); one-token rows must come first (they are the builder's decode segment)."""
    nd = sum(1 for _, _, after in rows if len(after) == 1)
    if any(len(after) == 1 for _, _, after in rows[nd:]):
        raise ValueError("one-token draft rows must come first")
    mode = "decode" if nd == len(rows) else ("extend" if nd == 0 else "mixed")
    return ScheduledBatch(
        mode=mode,
        request_ids=tuple(req.request_id for req, _, _ in rows),
        num_decode_seqs=nd,
        num_verify_seqs=0,
        input_ids=tuple(t for _, _, after in rows for t in after),
        seq_lens=tuple(len(after) for _, _, after in rows),
        start_positions=tuple(start for _, start, _ in rows),
        kv_pages=tuple(tuple(req.kv_pages) for req, _, _ in rows),
        mamba_slots=tuple(req.mamba_slot for req, _, _ in rows),
        verify_slots=(),
        logits_seqs=tuple(logits_seqs),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * len(rows),  # the head drafts as the base model
    )
