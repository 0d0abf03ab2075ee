"""Copy Mamba states into checkpoint slots (prefix caching), torch path.

conv_states: (num_slots, conv_dim, K-1); ssm_states: (num_slots, nheads, headdim, dstate).
Sources are tensors of candidate states (a working slot's state, or chunk-end states of a prefill)
gathered by index; destinations are checkpoint slots.
"""

from __future__ import annotations

import torch

from baton.kernels.backend import select_backend


def copy_states(
    dst_pool: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor
) -> None:
    """dst_pool[dst_slots[i]] = src[src_index[i]] for every i. dst_slots, src_index: (M,) int64."""
    if select_backend(src) == "triton":
        from baton.kernels.triton.state_copy import copy_states_triton

        copy_states_triton(dst_pool, dst_slots, src, src_index)
        return
    dst_pool[dst_slots] = src[src_index].to(dst_pool.dtype)
