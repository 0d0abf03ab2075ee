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
from baton.engine.executor.draft_metadata import (
    advance,
    retoken,
    same_rows,
    token_fields,
    with_tokens,
)
from baton.engine.executor.forward_metadata import ScheduledBatch
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
        # ids of the head's output hidden states the recorded plans leave (a chained pass's
        # possible sources)
        self.outputs: set[int] = set()

    def draft(self, batch: DraftBatch) -> torch.Tensor | None:
        """An MTP head's pass replayed from a plan (recorded by its first run), or None where
        the runner must run it eagerly. Two passes have plans: the first after a replayed
        target step (its rows and static metadata, the head's tokens in; the target's static
        hidden states as the source), and a chained pass over one-token rows padded like a
        decode step, from the hidden states a replayed pass left in its static output. A
        replay builds no metadata: it refills the recorded metadata from the target step's
        (engine/executor/draft_metadata.py). Called by ModelRunner.draft, under its inference
        mode."""
        if batch.hidden_from == "target":
            return self._first_pass(batch)
        if batch.hidden_from != "draft":
            return None
        runner = self.graphs.runner
        sched, source = batch.batch, runner.draft_hidden
        if (
            sched.mode != "decode"
            or sched.num_seqs > self.graphs.max_bs
            or id(source) not in self.outputs
        ):
            return None
        n = sched.num_seqs
        bs = next(s for s in self.graphs.sizes if s >= n)
        key = ("chain", bs, id(source))
        rows = batch.hidden_rows + (0,) * (bs - n)
        entry = self.plans.get(key)
        token_slots = self._step_token_slots(sched)
        if entry is not None and token_slots is not None:
            advance(entry[1], sched, token_slots)
            entry[4].numpy()[:] = rows
            return self._replay(entry, n)
        gather = torch.tensor(rows, dtype=torch.int64)
        md = self.graphs.build(self.graphs.pad(sched, bs))
        return self._draft_pass(key, md, lambda: source.index_select(0, gather), gather, n)

    def _first_pass(self, batch: DraftBatch) -> torch.Tensor | None:
        """The pass over the latest target step's own rows, if that step was replayed (or
        recorded) from a plan: its static metadata with the head's tokens."""
        step, last = self.graphs.runner.target_step, self.graphs.last_plan
        target = self.graphs.plans.get(last) if last is not None else None
        if (
            target is None
            or step is None
            or step[1] is not target[1]
            or not same_rows(step[0], batch.batch)
            or batch.hidden_rows != tuple(range(batch.batch.num_tokens))
        ):
            return None
        rows = target[1].forward.batch.input_ids.shape[0]  # the padded step's, in order
        key = ("target", last, token_fields(batch.batch, rows)[2])
        entry = self.plans.get(key)
        if entry is not None:
            retoken(entry[1], batch.batch)
            return self._replay(entry, len(key[2]))
        hidden = target[3]
        md = with_tokens(step[1], batch.batch)
        return self._draft_pass(key, md, lambda: hidden[:rows], None, len(key[2]))

    def _step_token_slots(self, sched: ScheduledBatch) -> torch.Tensor | None:
        """The rows of the replayed target step's token table a chained pass's rows read (the
        same requests with the same pages, covering the pass's positions), or None: the
        pass's metadata is built."""
        step, last = self.graphs.runner.target_step, self.graphs.last_plan
        target = self.graphs.plans.get(last) if last is not None else None
        if target is None or step is None or step[1] is not target[1]:
            return None
        done, cache = step[0], self.graphs.runner.cache
        page = cache.page_size
        row_of = {rid: row for row, rid in enumerate(done.request_ids)}
        rows = [row_of.get(rid, -1) for rid in sched.request_ids]
        if any(  # (a page entry per page table: the pages cover len // page_tables pages)
            row < 0
            or done.kv_pages[row] != pages
            or position >= page * (len(pages) // cache.page_tables)
            for row, pages, position in zip(rows, sched.kv_pages, sched.start_positions)
        ):
            return None
        forward = step[1].forward
        layout = forward.verify_attention if done.mode == "verify" else forward.decode_attention
        if rows == list(range(len(rows))):
            return layout.kv_indices
        return layout.kv_indices.index_select(0, torch.tensor(rows, dtype=torch.int64))

    def _draft_pass(self, key, md, prev, gather, rows: int) -> torch.Tensor | None:
        """Record the pass at `key` as it runs (eager from then on when it cannot be)."""
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
            if recorder.error is None:
                self.outputs.add(id(hidden))
            runner.draft_hidden = hidden
            return logits[:rows]
        plan, static_md, logits, hidden, static_gather = entry
        copy_from(static_md, md)
        if static_gather is not None:
            static_gather.copy_(gather)
        return self._replay(entry, rows)

    def _replay(self, entry: tuple, rows: int) -> torch.Tensor:
        plan, _, logits, hidden, _ = entry
        plan.replay()
        self.graphs.runner.draft_hidden = hidden
        return logits[:rows]
