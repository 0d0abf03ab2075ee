"""Prefix-cache checkpoints of a recurrent mixer's slot state (the track mask, DESIGN.md §6).

Every recurrent mixer keeps a conv window and a recurrent state per slot, and at each track
point of a step copies the TRUE state after that token into a checkpoint slot. The one metadata
builder says where (engine/executor/forward_metadata.py):

    track_state_src   into [decode rows' new states | prefill chunk-end states (S_p * C)]
    track_state_dst   checkpoint slots, one per entry (windows and recurrent states alike)
    track_window_indices, num_decode_tracks
                      decode entries name their decode row (its window is in the pool after
                      the update); prefill entries name a token whose window the conv returned

Mamba2 and gated DeltaNet share this copy: their states differ in shape only.
"""

from __future__ import annotations

import torch

from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.kernels.state_copy import copy_states


def checkpoint_states(
    md: Mamba2Metadata,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    windows: torch.Tensor | None,
    chunk_states: torch.Tensor | None,
) -> None:
    """conv_pool: (num_slots, channels, K-1); state_pool: (num_slots, *state); windows:
    (prefill track entries, channels, K-1) from the varlen conv, or None; chunk_states:
    (num_prefill_seqs, num_chunks, *state) from the prefill scan, or None (no prefill rows)."""
    ndt = md.num_decode_tracks
    decode_slots = md.decode_slots
    sources = [state_pool[decode_slots]]
    if chunk_states is not None:
        sources.append(chunk_states.flatten(0, 1))
    src = torch.cat(sources) if len(sources) > 1 else sources[0]
    copy_states(state_pool, md.track_state_dst, src, md.track_state_src)
    if ndt:
        rows = md.track_window_indices[:ndt]
        copy_states(conv_pool, md.track_state_dst[:ndt], conv_pool, decode_slots[rows])
    if windows is not None and windows.shape[0]:
        copy_states(
            conv_pool,
            md.track_state_dst[ndt:],
            windows,
            torch.arange(windows.shape[0], device=windows.device),
        )
