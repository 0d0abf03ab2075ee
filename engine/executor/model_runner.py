"""Runs one scheduled batch through the model: build metadata (the one builder), forward; and
the drafter's forwards (an MTP head) over rows that start from kept hidden states."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from baton.engine.cache.pools import StateCache
from baton.engine.executor.draft_batch import DraftBatch
from baton.engine.executor.draft_metadata import same_rows, with_tokens
from baton.engine.executor.forward_metadata import Mamba2Metadata, ScheduledBatch, build_metadata
from baton.engine.executor.metadata_buffers import MetadataBuffers
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.mtp import hidden_of_slots
from baton.kernels.backend import KERNELS_ENV, select_backend
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.mla import latent_attention_on_cpu


class ModelRunner:
    def __init__(self, model: CausalLM, cache: StateCache, device: torch.device | str):
        self.model = model
        self.cache = cache
        self.device = device
        self.config = model.config
        # With an MTP head: the final hidden states of the latest target forward and the output
        # of the latest draft forward (what the next draft forward starts from).
        self.target_hidden: torch.Tensor | None = None
        self.draft_hidden: torch.Tensor | None = None
        # ... and the latest target step's batch and metadata (padded, when the graph runner ran
        # it), whose layouts a draft forward over the same rows reuses
        self.target_step: tuple[ScheduledBatch, Mamba2Metadata] | None = None
        # Set by a graph runner that captures CPU steps: a draft pass replayed from its plan, or
        # None where it cannot (then the pass runs here, eagerly)
        self.captured_draft: Callable[[DraftBatch], torch.Tensor | None] | None = None
        # Eager steps vary in shape: these grow to the largest step seen, then stay.
        self.buffers = MetadataBuffers(device, ints=4096, kv_rows=16, kv_width=256, fixed=False)
        # A (1, heads, head_dim) query in the KV dtype: what the decode-kernel choice looks at
        # (its head_dim and dtype).
        # The paged pools decode attention reads: full attention's and the windowed layers'
        # K ((layers, tokens, kv_heads, head_dim); the same decode kernels read both), with a
        # query-shaped probe each, and MLA's latent pages (layers, tokens, latent).
        self._query_probes = {
            name: torch.empty(
                1, *cache.pools[name].shape[2:], dtype=cache.pools[name].dtype, device=device
            )  # fmt: skip
            for name in ("attention.k", "sliding_attention.k")
            if name in cache.pools
        }
        self._latent_pools = "mla.latent" in cache.pools
        # decode_reads_mask's answer, for the BATON_KERNELS value it was found under (what
        # else it looks at, the probes and the C library, stays for the process)
        self._reads_mask: tuple[str | None, bool] | None = None

    def decode_reads_mask(self) -> bool:
        """Whether decode attention runs a torch path, the only ones that read a mask (the C and
        Triton decode kernels stop at each row's kv_len). Asked per step and found again when
        BATON_KERNELS changes, which may change the path (finding it cost ~30 us a step). A
        model whose paged state none of these layers attends over (a layer
        of its own) has no probe: its mask is always built (a few host ops a step), so its torch
        path never reads a missing one."""
        forced = os.environ.get(KERNELS_ENV)
        if self._reads_mask is None or self._reads_mask[0] != forced:
            self._reads_mask = (forced, self._find_reads_mask())
        return self._reads_mask[1]

    def _find_reads_mask(self) -> bool:
        pools = self.cache.pools
        if not self._query_probes and not self._latent_pools:
            return bool(self.cache.paged)
        if self._latent_pools and not latent_attention_on_cpu(pools["mla.latent"][0]):
            return True  # MLA has no Triton kernel: off the C kernels it reads the mask
        return any(
            select_backend(probe) != "triton"
            and not cpu_ops.decode_attention_supported(probe, pools[name][0])
            for name, probe in self._query_probes.items()
        )

    def build(self, sched: ScheduledBatch) -> Mamba2Metadata:
        return build_metadata(
            sched,
            page_size=self.cache.page_size,
            page_tables=self.cache.page_tables,
            chunk_size=self.cache.chunk_size,
            window_width=self.cache.window_width,
            buffers=self.buffers,
            decode_mask=self.decode_reads_mask(),
            kv_capacity=None,
            track_capacity=None,
        )

    @torch.inference_mode()
    def forward(self, sched: ScheduledBatch) -> tuple[Mamba2Metadata, torch.Tensor]:
        """Returns the metadata and float32 logits for its `logits_indices` rows."""
        md = self.build(sched)
        logits = self.run_model(md)
        self.keep_step(sched, md)
        return md, logits

    def keep_step(self, sched: ScheduledBatch, md: Mamba2Metadata) -> None:
        """With an MTP head, keep the target step's batch and metadata (padded when the graph
        runner ran it: its real rows come first) for the first draft pass over its rows."""
        if self.model.mtp is not None:
            self.target_step = (sched, md)

    def run_model(self, md: Mamba2Metadata) -> torch.Tensor:
        """The target forward on built metadata: logits, keeping the hidden states for an MTP
        head to draft from."""
        if self.model.mtp is None:
            return self.model(md, self.cache)
        logits, self.target_hidden = self.model.forward_hidden(md, self.cache)
        return logits

    @torch.inference_mode()
    def draft(self, batch: DraftBatch) -> torch.Tensor:
        """One forward of the MTP head (engine/executor/draft_batch.py): float32 draft logits
        for the batch's logits rows. A first pass over the latest target step's own rows takes
        that step's metadata with its own tokens instead of building the same layouts again."""
        if self.captured_draft is not None:
            logits = self.captured_draft(batch)
            if logits is not None:
                return logits
        step = self.target_step
        if batch.hidden_from == "target" and step is not None and same_rows(step[0], batch.batch):
            if batch.hidden_rows != tuple(range(batch.batch.num_tokens)):
                raise ValueError("a first draft pass reads the target's rows in order")
            md = with_tokens(step[1], batch.batch)
            # every row of the step in order (padding rows included)
            rows = md.forward.batch.input_ids.shape[0]
            logits, self.draft_hidden = self.model.draft(md, self.cache, self.target_hidden[:rows])
            return logits
        md = self.build(batch.batch)
        if batch.hidden_from == "slots":
            prev = hidden_of_slots(self.cache, md.decode_slots)
        else:
            source = self.target_hidden if batch.hidden_from == "target" else self.draft_hidden
            rows = torch.tensor(batch.hidden_rows, dtype=torch.int64, device=source.device)
            prev = source[rows]
        logits, self.draft_hidden = self.model.draft(md, self.cache, prev)
        return logits
