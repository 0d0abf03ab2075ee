"""What every family's `...ForCausalLM` shares: a backbone that maps the batch to final hidden
states, an lm_head (tied to the embeddings or not), logits for the sampled rows only, an optional
multi-token-prediction head (`mtp`, engine/layers/mtp.py) that drafts with the same embedding and
lm_head; and the vocab-parallel embedding.

Under tensor parallelism the vocabulary is cut in equal parts (the last padded with zero rows):
each rank embeds the ids in its part (zeros elsewhere, all-reduced) and computes the logits of
its part, which rank 0 gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.config import ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.mtp import keep_hidden
from baton.engine.lora.layer import slot_rows


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding's `weight` name and result; at TP > 1 this rank's rows of the table."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = tp = parallel.current()
        self.first, rows = parallel.padded_part(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        if tp.size > 1:
            parallel.shard(self.weight, parallel.Slices(dim=0, ranges=((self.first, rows),)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))


class CausalLM(nn.Module):
    """`self.model` is the family's backbone (`forward(md, cache) -> hidden`, with its token
    embedding at `self.model.<embedding_name>`). The logits are divided by `logits_scaling`
    (Granite), multiplied by `lm_head_multiplier` (Falcon-H1) and soft-capped to
    cap * tanh(logits / cap) (`logits_soft_cap`, RecurrentGemma), in the model dtype, as
    transformers does."""

    def __init__(
        self,
        config: ModelConfig,
        backbone: nn.Module,
        embedding_name: str,
        *,
        logits_scaling: float = 1.0,
        lm_head_multiplier: float = 1.0,
        logits_soft_cap: float | None = None,
        mtp: nn.Module | None = None,
    ):
        """mtp: the family's MTP head (`forward(embeds, prev_hidden, md, cache) -> hidden`),
        weights under `mtp.`; None when the checkpoint has none or speculation does not use it."""
        super().__init__()
        self.config = config
        self.logits_scaling = logits_scaling
        self.lm_head_multiplier = lm_head_multiplier
        self.logits_soft_cap = logits_soft_cap
        self.model = backbone
        self.embedding_name = embedding_name
        self.mtp = mtp
        self.tp = tp = parallel.current()
        first, rows = parallel.padded_part(config.vocab_size, tp)
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        if tp.size > 1:
            parallel.shard(self.lm_head.weight, parallel.Slices(dim=0, ranges=((first, rows),)))
        self.tied_parameters: tuple[str, ...] = ()
        # The adapter slot table (engine/lora/slots.py) when LoRA is enabled: the backbone's
        # adaptable projections are wrapped and read each row's slot from the metadata.
        self.adapters = None
        # CPU: the float32 logits of the latest forward, widened in place (see _widen_logits).
        self._logits_f32 = torch.empty(0, rows, device="cpu")
        if config.tie_word_embeddings:
            self.lm_head.weight = getattr(self.model, embedding_name).weight
            self.tied_parameters = ("lm_head.weight",)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Returns float32 logits for the rows `md.forward.batch.logits_indices` (at TP > 1 on
        rank 0; the other ranks return their vocabulary part, which nobody reads)."""
        return self.forward_hidden(md, cache)[0]

    def forward_hidden(
        self, md: Mamba2Metadata, cache: StateCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits as `forward`, the final hidden states of every token (num_tokens, hidden)):
        what an MTP head drafts from. With an MTP head, each request's last hidden state is
        kept in its slot too (engine/layers/mtp.py)."""
        if self.adapters is None:
            hidden = self.model(md, cache)
        else:
            batch = md.forward.batch
            with slot_rows(batch.lora_slots, self.adapters.slot_of_column, batch.has_lora):
                hidden = self.model(md, cache)
        if self.mtp is not None:
            keep_hidden(hidden, md, cache)
        return self.logits(hidden[md.forward.batch.logits_indices]), hidden

    def draft(
        self, md: Mamba2Metadata, cache: StateCache, prev_hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the MTP head: md's input ids are the tokens after each position,
        prev_hidden (num_tokens, hidden) the hidden states at those positions (the target's,
        or the head's own output when chained). Returns (draft logits for the logits rows, the
        head's output hidden states)."""
        embeds = getattr(self.model, self.embedding_name)(md.forward.batch.input_ids)
        hidden = self.mtp(embeds, prev_hidden, md, cache)
        return self.logits(hidden[md.forward.batch.logits_indices]), hidden

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden rows (num_rows, hidden)."""
        logits = self.lm_head(rows)
        if self.tp.size > 1:
            logits = self.tp.gather_last_dim(logits)[:, : self.config.vocab_size]
        # In the model dtype, as transformers: Granite divides, Falcon-H1 multiplies.
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.lm_head_multiplier != 1.0:
            logits = logits * self.lm_head_multiplier
        if self.logits_soft_cap is not None:
            logits = torch.tanh(logits / self.logits_soft_cap) * self.logits_soft_cap
        if logits.dtype != torch.float32 and logits.device.type == "cpu":
            return self._widen_logits(logits)
        return logits.float()

    def _widen_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.float()` into a buffer kept across forwards: a fresh (rows, vocab) float32
        tensor is a multi-MB allocation that glibc maps and page-faults in anew each step (~1 ms
        on a 32 x 32000 decode batch, 10x the copy itself). The caller (the engine's step) reads
        and may edit the logits only until the next forward, which overwrites them."""
        rows, vocab = logits.shape
        if self._logits_f32.shape[0] < rows or self._logits_f32.shape[1] != vocab:
            self._logits_f32 = torch.empty(rows, vocab, dtype=torch.float32, device="cpu")
        return self._logits_f32[:rows].copy_(logits)
