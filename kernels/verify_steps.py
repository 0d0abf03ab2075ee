"""Speculative verify for a recurrent layer without a multi-token kernel: q one-token steps.

A verify sequence feeds q = k + 1 tokens (rows request-major); the layer must leave its state
after token i in slot `md.verify_slots[:, i + 1]` (column 0 is the slot read; column 1 is the
working slot itself, in place; engine/executor/forward_metadata.py). Here token i of every
verifying request is one ordinary decode step on column i + 1, after column i's state is copied
into it, so each kept state is the one plain decoding would have left (rollback is choosing a
column). Mamba2 has its own multi-token kernels; the gated DeltaNet mixer (kernels/gdn_mixer.py),
Mamba1's selective scan and the short convolutions (Jamba, Falcon-Mamba, Mamba, LFM2) go through
this one, with their decode kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def verify_by_steps(
    slots: torch.Tensor,
    pools: Sequence[torch.Tensor],
    step: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """slots: (nv, q + 1) int64; pools: the slot tensors `step` updates; step(i, dst) runs token
    i of every request (rows i, i + q, ... of the verify segment) on slots `dst` and returns its
    (nv, ...) output. Returns the outputs in the segment's row order: (nv * q, ...)."""
    nv, q = slots.shape[0], slots.shape[1] - 1
    outs = []
    for i in range(q):
        src, dst = slots[:, i].contiguous(), slots[:, i + 1].contiguous()
        for pool in pools:  # (for i = 0 the working slot onto itself)
            pool.index_copy_(0, dst, pool[src])
        outs.append(step(i, dst))
    return torch.stack(outs, dim=1).reshape(nv * q, *outs[0].shape[1:])


def token_rows(t: torch.Tensor, i: int, q: int) -> torch.Tensor:
    """Token i of every request in a verify segment's rows (request-major, q per request)."""
    return t[i::q].contiguous()
