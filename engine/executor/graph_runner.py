"""Decode at fixed padded batch sizes: CUDA graphs on GPU, the same padded step on CPU.

A decode batch of n requests runs at the smallest capture size bs >= n. The n - bs padded rows
feed token 0 at position 0 into the dummy KV page 0 and the dummy Mamba slot 0, so whatever they
write lands where no live request reads; a live request never owns page 0 or slot 0 (asserted).

Both capture and replay build metadata with the one `build_metadata` (the builder every eager
step uses) at fixed capacities into this runner's MetadataBuffers, allocated once for the
largest batch and the full KV capacity: one host-to-device copy of int32s per step (the page
table as pages, as wide as the batch's longest sequence), the decode token table expanded on
the device in place. `copy_from` then moves what the builder made elsewhere (int64 views) into
the captured tensors and skips those already built in place. Checkpoints (the track mask) work inside graphs: each size is captured
twice, without and with the checkpoint copies; the host flag `has_mamba_track_mask` picks the
graph to replay, and the device-side track buffers hold exactly bs entries, the unused ones
copying dummy slot 0 onto itself. Capturing both variants keeps the common no-checkpoint step
free of copy work instead of paying for a masked copy on every step.

On the CPU the same step is captured as a plan (engine/executor/cpu_plan.py): the first step
of each (mode, batch size, tracking, any adapter) runs eagerly under a dispatcher-level recorder
over the fixed buffers, later ones copy their metadata in (`copy_from`, as for graphs) and replay the
recorded operator calls in C++ with no Python per layer. A step the recorder cannot capture
(an operator that hands a host value to Python, or whose output shape follows the data) runs
eagerly at that key from then on. Without the C++ extension, or with `capture=None`, the padded
step runs eagerly, which still exercises padding, static buffers and the builder.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch

from baton.engine.executor.cpu_plan import Recorder, new_plan
from baton.engine.executor.draft_plans import DraftPlans
from baton.engine.executor.forward_metadata import (
    Mamba2Metadata,
    ScheduledBatch,
    TrackPoint,
    build_metadata,
)
from baton.engine.executor.metadata_buffers import MetadataBuffers
from baton.engine.executor.model_runner import ModelRunner
from baton.engine.executor.static_copy import copy_from

log = logging.getLogger(__name__)

# Largest CPU batch recorded by default: a plan keeps every intermediate its step made, and past
# a few dozen rows the step's arithmetic outweighs the Python a plan saves.
CPU_CAPTURE_MAX_BS = 16


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 8))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_bs: int,
        kv_capacity: int,
        capture: Literal["cuda", "cpu"] | None,
        verify_width: int | None,
    ):
        """capture: CUDA graphs, CPU plans or neither (the padded step run eagerly);
        verify_width: q = k + 1, the tokens a speculative verify row feeds (None: no
        speculation, decode steps only)."""
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = max_bs
        self.kv_capacity = kv_capacity
        if capture == "cuda" and not torch.cuda.is_available():
            capture = None
        self.capture = capture
        self.use_cuda_graphs = capture == "cuda"
        page = runner.cache.page_size
        # padding verify rows sit at positions 0 .. q - 1 of dummy page 0
        self.verify_width = (
            verify_width if verify_width is not None and verify_width <= page else None
        )
        # ints per row: decode (10 + its pages); verify (6 q + 3 + its pages: q each of ids,
        # positions, slots, logits rows, adapter slots, q + 1 state slots, the working slot and
        # kv_len)
        # With two page tables (ModelStateSpec.page_tables) each row has a second slot mapping
        # entry per token and a second page table.
        tables = runner.cache.page_tables
        per_row = max(10, 6 * self.verify_width + 3 if self.verify_width else 0)
        per_row += (tables - 1) * (self.verify_width or 1)
        self.static_ints = max_bs * (per_row + tables * -(-kv_capacity // page))
        # Graphs captured the addresses of these buffers: sized once for the worst step (every
        # row at full capacity, every row checkpointing), never reallocated.
        self.buffers = self.static_buffers() if capture else runner.buffers
        # (mode, batch size, tracking, any adapter) -> (graph, its metadata, logits, final hidden
        # states or None)
        self.graphs: dict[
            tuple[str, int, bool, bool],
            tuple[torch.cuda.CUDAGraph, Mamba2Metadata, torch.Tensor, torch.Tensor | None],
        ] = {}
        # (mode, batch size, tracking, any adapter) -> (plan, its metadata, logits, final hidden
        # states or None), or None where the step could not be captured (it runs eagerly)
        self.plans: dict[
            tuple[str, int, bool, bool],
            tuple[Any, Mamba2Metadata, torch.Tensor, torch.Tensor | None] | None,
        ] = {}
        # the MTP head's draft passes, captured beside the target's steps (draft_plans.py)
        self.drafts = DraftPlans(self)
        self.last_plan: tuple[str, int, bool, bool] | None = (
            None  # the plan the latest step replayed
        )
        self.num_padded_steps = 0
        self.num_replays = 0
        if capture == "cpu" and runner.model.mtp is not None:
            runner.captured_draft = self.drafts.draft
        # padding rows write their K/V into dummy page 0; a model that keeps no pages (capacity
        # 0: no attention) has none for them
        self.dummy_pages = (0,) * runner.cache.page_tables if kv_capacity else ()

    @property
    def draft_plans(self) -> dict[tuple, tuple | None]:
        return self.drafts.plans

    def static_buffers(self) -> MetadataBuffers:
        page = self.runner.cache.page_size
        return MetadataBuffers(
            self.runner.device,
            ints=self.static_ints,
            kv_rows=self.max_bs,
            kv_width=-(-self.kv_capacity // page) * page,
            fixed=True,
        )

    def can_run(self, sched: ScheduledBatch) -> bool:
        if sched.num_seqs > self.max_bs or sched.prompt_logprob_seqs:
            return False
        if sched.mode == "decode":
            return True
        return (
            sched.mode == "verify"
            and sched.num_decode_seqs == 0
            and self.verify_width is not None
            and sched.seq_lens[0] == self.verify_width
        )

    def pad(self, sched: ScheduledBatch, bs: int) -> ScheduledBatch:
        n, extra = sched.num_seqs, bs - sched.num_seqs
        if (
            0 in sched.mamba_slots
            or any(0 in pages for pages in sched.kv_pages)
            or any(0 in slots for slots in sched.verify_slots)
        ):
            raise AssertionError("a live request holds the dummy slot 0 or the dummy page 0")
        if sched.mode == "verify":
            q = self.verify_width
            return dataclasses.replace(
                sched,
                request_ids=sched.request_ids + ("",) * extra,
                num_verify_seqs=bs,
                input_ids=sched.input_ids + (0,) * (extra * q),
                seq_lens=sched.seq_lens + (q,) * extra,
                start_positions=sched.start_positions + (0,) * extra,
                kv_pages=sched.kv_pages + (self.dummy_pages,) * extra,
                mamba_slots=sched.mamba_slots + (0,) * extra,
                verify_slots=sched.verify_slots + ((0,) * q,) * extra,
                logits_seqs=sched.logits_seqs + tuple(range(n, bs)),
                lora_slots=sched.lora_slots + (-1,) * extra,
            )
        return dataclasses.replace(
            sched,
            request_ids=sched.request_ids + ("",) * extra,
            num_decode_seqs=bs,
            input_ids=sched.input_ids + (0,) * extra,
            seq_lens=sched.seq_lens + (1,) * extra,
            start_positions=sched.start_positions + (0,) * extra,
            kv_pages=sched.kv_pages + (self.dummy_pages,) * extra,
            mamba_slots=sched.mamba_slots + (0,) * extra,
            lora_slots=sched.lora_slots + (-1,) * extra,
            logits_seqs=tuple(range(bs))
            if sched.logits_seqs == tuple(range(n))
            else sched.logits_seqs,
        )

    def build(self, padded: ScheduledBatch) -> Mamba2Metadata:
        cache = self.runner.cache
        return build_metadata(
            padded,
            page_size=cache.page_size,
            page_tables=cache.page_tables,
            chunk_size=cache.chunk_size,
            window_width=cache.window_width,
            buffers=self.buffers,
            decode_mask=self.runner.decode_reads_mask(),
            # Static key width only matters for a captured step; eager keeps it tight.
            kv_capacity=self.kv_capacity if self.capture else None,
            track_capacity=padded.num_seqs,
        )

    @torch.inference_mode()
    def forward(self, sched: ScheduledBatch) -> tuple[Mamba2Metadata, torch.Tensor]:
        """Like ModelRunner.forward for a decode or verify batch; logits rows beyond the real
        batch's are cut (a verify row's are its q rows, the padding rows' come after them)."""
        n = sched.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        padded = self.pad(sched, bs)
        md = self.build(padded)
        self.num_padded_steps += 1
        rows = n * self.verify_width if sched.mode == "verify" else n
        key = (sched.mode, bs, padded.has_mamba_track_mask, md.forward.batch.has_lora)
        if self.capture == "cpu":
            return self._forward_cpu(sched, key, md, rows)
        if not self.use_cuda_graphs:
            logits = self.runner.run_model(md)
            self.runner.keep_step(sched, md)
            return md, logits[:rows]
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, static_md, static_logits, static_hidden = self.graphs[key]
        copy_from(static_md, md)
        graph.replay()
        if static_hidden is not None:  # an MTP head drafts from the replayed hidden states
            self.runner.target_hidden = static_hidden
        self.runner.keep_step(sched, static_md)
        return static_md, static_logits[:rows]

    def _forward_cpu(
        self, sched: ScheduledBatch, key: tuple[str, int, bool, bool], md: Mamba2Metadata, rows: int
    ) -> tuple[Mamba2Metadata, torch.Tensor]:
        """Replay the plan recorded at `key`, or record this very step as it runs."""
        self.last_plan = None
        if key in self.plans and self.plans[key] is None:  # could not be captured
            logits = self.runner.run_model(md)
            self.runner.keep_step(sched, md)
            return md, logits[:rows]
        if key not in self.plans:
            plan = new_plan()
            with Recorder(plan) as recorder:
                logits = self.runner.run_model(md)
            if recorder.error is not None:
                log.info("the CPU %s step at batch %d runs eagerly: %s", key[0], key[1],
                         recorder.error)  # fmt: skip
                self.plans[key] = None
            else:
                hidden = self.runner.target_hidden if self.runner.model.mtp is not None else None
                self.plans[key] = (plan, md, logits, hidden)
                self.last_plan = key
            self.runner.keep_step(sched, md)
            return md, logits[:rows]
        plan, static_md, static_logits, static_hidden = self.plans[key]
        copy_from(static_md, md)
        plan.replay()
        self.num_replays += 1
        self.last_plan = key
        if static_hidden is not None:  # an MTP head drafts from the replayed hidden states
            self.runner.target_hidden = static_hidden
        self.runner.keep_step(sched, static_md)
        return static_md, static_logits[:rows]

    def dummy_batch(self, mode: str, bs: int, track: bool, lora: bool) -> ScheduledBatch:
        """bs padding rows only: capturing it touches nothing but dummy page 0 and slot 0. A
        verify batch's rows feed q tokens each (and never checkpoint in the forward). `lora`:
        the rows run under adapter slot 0 (a step with adapters captures their deltas)."""
        q = self.verify_width if mode == "verify" else 1
        points = (TrackPoint(seq_index=0, token_offset=0, dst_slot=0),) if track else ()
        return ScheduledBatch(
            mode="verify" if mode == "verify" else "decode",
            request_ids=("",) * bs,
            num_decode_seqs=0 if mode == "verify" else bs,
            num_verify_seqs=bs if mode == "verify" else 0,
            input_ids=(0,) * (bs * q),
            seq_lens=(q,) * bs,
            start_positions=(0,) * bs,
            kv_pages=(self.dummy_pages,) * bs,
            mamba_slots=(0,) * bs,
            verify_slots=((0,) * q,) * bs if mode == "verify" else (),
            logits_seqs=tuple(range(bs)),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=track,
            track_points=points,
            lora_slots=(0 if lora else -1,) * bs,
        )

    def _capture(self, mode: str, bs: int, track: bool, lora: bool):
        """Capture one graph over static buffers built from an all-padding batch (warm-up first);
        `lora`: its rows run under adapter slot 0 (the deltas are in the graph)."""
        static_md = self.build(self.dummy_batch(mode, bs, track, lora))
        model = self.runner.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.runner.run_model(static_md)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = self.runner.run_model(static_md)
        static_hidden = self.runner.target_hidden if model.mtp is not None else None
        return graph, static_md, static_logits, static_hidden
