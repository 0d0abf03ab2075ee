"""What every multi-token-prediction (MTP) head shares, whatever its family's weight names.

An MTP layer predicts the token after next: at position p it reads the target model's final
hidden state h_p and the embedding of the token at p + 1, and its output (through the target's
lm_head) predicts the token at p + 2. Chained, its own output hidden replaces h for the next
position, so one layer drafts k tokens (vLLM's num_speculative_tokens > num_nextn_predict_layers).

    fuse:   x = proj(cat(norm_e(embed(token_{p+1})), norm_h(h_p)))    (family names: NemotronH
                                                                       enorm / hnorm / eh_proj)
    blocks: the family's own decoder blocks (attention with its own K/V, MoE, ...)
    out:    final norm -> next hidden; lm_head(out) -> draft logits

State (declared here, kept by the pools like any layer's):
    attention K/V of the MTP blocks   the family declares them as ordinary attention layers
                                      after its own (built over the prompt during prefill, kept
                                      in the prefix cache, handed over in PD with the pages)
    "mtp.hidden"  slot, (hidden,)     the target's final hidden state after the last token a
                                      request fed (written by the target's forward, per position
                                      in a verify, so acceptance keeps the right one): what a
                                      decode worker needs to draft at once after a PD handover,
                                      without the prefill worker knowing its k
"""

from __future__ import annotations

import torch

from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, StateTensor
from baton.engine.executor.forward_metadata import Mamba2Metadata

MTP_KIND = "mtp"


def mtp_state(hidden_size: int, dtype: torch.dtype) -> LayerState:
    """The target's last hidden state per request (replicated under TP: every rank holds the
    whole residual stream). Not checkpointed: a request resumed from a prefix checkpoint feeds
    at least one token, whose hidden state its own forward writes."""
    return LayerState(
        kind=MTP_KIND,
        tensors=(
            StateTensor(
                name="hidden",
                kind="slot",
                shape=(hidden_size,),
                dtype=dtype,
                split=None,
                checkpointed=False,
            ),
        ),
        chunk_size=None,
        window_width=None,
        page_window=None,
    )


def keep_hidden(hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> None:
    """hidden: (num_tokens, hidden) the target's final hidden states. Each sequence's state
    after its last fed token goes to its working slot; a verify sequence's after every token
    goes to the slot that keeps that position's recurrent state (md.verify_slots)."""
    pool = cache.layer(MTP_KIND, 0)["hidden"]  # (num_slots, hidden)
    batch = md.forward.batch
    nd, nv = batch.num_decode_tokens, batch.num_verify_tokens
    hidden = hidden.to(pool.dtype)
    if nd:
        pool.index_copy_(0, md.decode_slots, hidden[:nd])
    if nv:
        pool.index_copy_(0, md.verify_slots[:, 1:].reshape(-1), hidden[nd : nd + nv])
    if md.prefill_slots.shape[0]:
        last = md.chunk_layout.cu_seqlens[1:].long() - 1 + nd + nv
        pool.index_copy_(0, md.prefill_slots, hidden[last])


def hidden_of_slots(cache: StateCache, slots: torch.Tensor) -> torch.Tensor:
    """(len(slots), hidden): the kept hidden states of these working slots."""
    return cache.layer(MTP_KIND, 0)["hidden"][slots]
