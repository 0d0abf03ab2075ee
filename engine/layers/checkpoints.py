"""Prefix-cache checkpoints of a recurrent layer's slot state, written during the forward at the
track points the one metadata builder lists (engine/executor/forward_metadata.py): entries of
decode rows first (`md.num_decode_tracks` of them), then entries of prefill tokens, each with its
checkpoint slot in `md.track_state_dst`.

    conv windows   decode entries: the row's pool window, already updated by this step;
                   prefill entries: the window after the token (the varlen conv returns them)
    scan states    [decode rows' updated pool states | prefill chunk-end states (S_p * C)],
                   indexed by `md.track_state_src` (prefill entries sit at aligned chunk ends)
"""

from __future__ import annotations

import torch

from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.kernels.state_copy import copy_states


def checkpoint_windows(
    md: Mamba2Metadata, conv_pool: torch.Tensor, windows: torch.Tensor | None
) -> None:
    """conv_pool: (num_slots, dim, K-1); windows: (prefill entries, dim, K-1) or None when this
    step has no prefill rows."""
    ndt = md.num_decode_tracks
    if ndt:
        rows = md.track_window_indices[:ndt]
        copy_states(conv_pool, md.track_state_dst[:ndt], conv_pool, md.decode_slots[rows])
    if windows is not None and windows.shape[0]:
        copy_states(
            conv_pool,
            md.track_state_dst[ndt:],
            windows,
            torch.arange(windows.shape[0], device=windows.device),
        )


def checkpoint_states(
    md: Mamba2Metadata, state_pool: torch.Tensor, chunk_states: torch.Tensor | None
) -> None:
    """state_pool: (num_slots, *state); chunk_states: (S_p, num_chunks, *state) or None when
    this step has no prefill rows."""
    sources = [state_pool[md.decode_slots]]
    if chunk_states is not None:
        sources.append(chunk_states.flatten(0, 1))
    src = torch.cat(sources) if len(sources) > 1 else sources[0]
    copy_states(state_pool, md.track_state_dst, src, md.track_state_src)
