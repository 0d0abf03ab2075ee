"""The MTP head's draft passes captured on the CPU beside the target's steps (the graph runner's
plans, engine/executor/graph_runner.py). Two passes have plans: the first after a replayed target
step (its rows and static metadata, the head's tokens in; the target's static hidden states as
the source), and a chained pass over one-token rows padded like a decode step, gathering from
the hidden states a replayed pass left in its static output. Each is recorded by its first run
and replayed after; a pass the recorder cannot capture runs eagerly at its key from then on."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from baton.engine.executor.cpu_plan import Recorder, new_plan
from baton.engine.executor.draft_batch import DraftBatch
from baton.engine.executor.forward_metadata import same_rows, with_tokens
from baton.engine.executor.static_copy import copy_from

if TYPE_CHECKING:
    from baton.engine.executor.graph_runner import DecodeGraphRunner

# Draft-pass plans are keyed by which rows draft as well: past this many, new keys run eagerly.
MAX_DRAFT_PLANS = 64


class DraftPlans:
    def __init__(self, graphs: DecodeGraphRunner):
        self.graphs = graphs
        # key -> (plan, its metadata, logits, the head's output hidden states, the rows of the
        # hidden source it gathers or None), or None (eager at that key)
        self.plans: dict[tuple, tuple | None] = {}

    @torch.inference_mode()
    def draft(self, batch: DraftBatch) -> torch.Tensor | None:
        """An MTP head's pass replayed from a plan (recorded by its first run), or None where
        the runner must run it eagerly. Two passes have plans: the first after a replayed
        target step (its rows and static metadata, the head's tokens in; the target's static
        hidden states as the source), and a chained pass over one-token rows padded like a
        decode step, from the hidden states a replayed pass left in its static output."""
        runner = self.graphs.runner
        step = runner.target_step
        if batch.hidden_from == "target":
            entry = (
                self.graphs.plans.get(self.graphs.last_plan)
                if self.graphs.last_plan is not None
                else None
            )
            if (
                entry is None
                or step is None
                or step[1] is not entry[1]
                or not same_rows(step[0], batch.batch)
                or batch.hidden_rows != tuple(range(batch.batch.num_tokens))
            ):
                return None
            md = with_tokens(step[1], batch.batch)
            owners = md.forward.batch.logits_row_owner
            rows = md.forward.batch.input_ids.shape[0]
            hidden = entry[3]
            key = ("target", self.graphs.last_plan, owners)
            return self._draft_pass(key, md, lambda: hidden[:rows], None, len(owners))
        if batch.hidden_from != "draft":
            return None
        sched, source = batch.batch, runner.draft_hidden
        outputs = {id(e[3]) for e in self.plans.values() if e is not None}
        if (
            sched.mode != "decode"
            or sched.num_seqs > self.graphs.max_bs
            or id(source) not in outputs
        ):
            return None
        n = sched.num_seqs
        bs = next(s for s in self.graphs.sizes if s >= n)
        md = self.graphs.build(self.graphs.pad(sched, bs))
        key = ("chain", bs, id(source))
        gather = torch.tensor(batch.hidden_rows + (0,) * (bs - n), dtype=torch.int64)
        return self._draft_pass(key, md, lambda: source.index_select(0, gather), gather, n)

    def _draft_pass(self, key, md, prev, gather, rows: int) -> torch.Tensor | None:
        runner, model = self.graphs.runner, self.graphs.runner.model
        entry = self.plans.get(key, ())
        if entry is None or (entry == () and len(self.plans) >= MAX_DRAFT_PLANS):
            return None
        if entry == ():
            plan = new_plan()
            with Recorder(plan) as recorder:
                logits, hidden = model.draft(md, runner.cache, prev())
            self.plans[key] = (
                None if recorder.error is not None else (plan, md, logits, hidden, gather)
            )
            runner.draft_hidden = hidden
            return logits[:rows]
        plan, static_md, logits, hidden, static_gather = entry
        copy_from(static_md, md)
        if static_gather is not None:
            static_gather.copy_(gather)
        plan.replay()
        runner.draft_hidden = hidden
        return logits[:rows]
