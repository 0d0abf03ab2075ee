"""Selective state update: one (or k) recurrent Mamba2 steps per request on pool slots, torch path.

    state <- state * exp(dt * A) + dt * x ⊗ B
    y      = state · C + D * x

ssm_states pool: (num_slots, nheads, headdim, dstate), float32 by default. Slot 0 is the dummy
slot: padded rows point there and every live slot they do not own stays untouched.
"""

from __future__ import annotations

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.ssd import discretize_dt
from baton.kernels.workspace import scratch


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """x: (batch, nheads, headdim); dt: (batch, nheads) raw; A, D, dt_bias: (nheads,);
    B, C: (batch, ngroups, dstate); state_indices: (batch,) int64. Returns y like x."""
    if select_backend(x) == "triton":
        from baton.kernels.triton.ssu import selective_state_update_triton

        return selective_state_update_triton(
            ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_limit
        )
    if cpu_ops.ssu_supported(ssm_states, x):
        dt = discretize_dt(dt, dt_bias, dt_limit)
        return cpu_ops.selective_state_update_cpu(ssm_states, x, dt, A, B, C, D, state_indices)
    return selective_state_update_torch(
        ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_limit
    )


def selective_state_update_torch(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    batch, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    dt = discretize_dt(dt, dt_bias, dt_limit)  # (batch, H)
    # Gather into a reused buffer and update in place: no fresh state-sized temporaries.
    state = scratch("ssu_state", (batch, H, P, N), torch.float32, x.device)
    if ssm_states.dtype == torch.float32:
        torch.index_select(ssm_states, 0, state_indices, out=state)
    else:
        state.copy_(ssm_states.index_select(0, state_indices))
    state5 = state.view(batch, G, R, P, N)
    state5.mul_(torch.exp(dt * A.float()).view(batch, G, R, 1, 1))
    xdt = (x.float() * dt.unsqueeze(-1)).view(batch, G, R, P, 1)
    state5.addcmul_(xdt, B.float().view(batch, G, 1, 1, N))
    ssm_states.index_copy_(0, state_indices, state.to(ssm_states.dtype))
    y = torch.bmm(state.view(batch * G, R * P, N), C.float().reshape(batch * G, N, 1))
    return (y.view(batch, H, P) + x.float() * D.float().view(1, H, 1)).to(x.dtype)


def selective_state_update_multi(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """k tokens per request (speculative verify): x: (batch, k, nheads, headdim), dt: (batch, k,
    nheads), B, C: (batch, k, ngroups, dstate); state_indices: (batch, k + 1): column 0 is the
    slot read, column i + 1 receives the state after token i. Returns y: (batch, k, nheads, headdim)."""
    if select_backend(x) == "triton":
        from baton.kernels.triton.ssu import selective_state_update_multi_triton

        return selective_state_update_multi_triton(
            ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, dt_limit
        )
    k = x.shape[1]
    ys = []
    read = state_indices[:, 0]
    for i in range(k):  # k is a handful of draft tokens, not a prompt
        write = state_indices[:, i + 1]
        if not torch.equal(read, write):
            ssm_states[write] = ssm_states[read]
        ys.append(
            selective_state_update(
                ssm_states, x[:, i], dt[:, i], A, B[:, i], C[:, i], D, dt_bias, write, dt_limit
            )
        )
        read = write
    return torch.stack(ys, dim=1)
