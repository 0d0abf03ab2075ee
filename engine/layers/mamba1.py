"""The Mamba1 mixer (Mamba, Falcon-Mamba, Jamba): in_proj -> [x | z]; causal conv1d + SiLU on x;
x_proj -> [dt_low | B | C]; dt_proj; selective scan with a per-channel A (prefill) or the
one-token update (decode), D skip and the silu(z) gate in the scan kernels; out_proj. Parameter
names are transformers' (`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`).

Family variants are parameters (Mamba1Config.bcdt_norm): dt_low, B and C go through RMS norms
with weights (Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`), through weightless ones
(Falcon-Mamba's, eps `mixer_rms_eps`), or through none (Mamba).

Under tensor parallelism the channels (d_inner) are split evenly: in_proj's x and z rows, the
conv, dt_proj's rows, A_log, D and out_proj's columns follow them; x_proj reads every channel,
so each rank's partial [dt_low | B | C] is all-reduced (vLLM's RowParallelLinear x_proj) and
the norms see whole vectors. The state spec splits the conv window and the SSM state by the same
channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.checkpoints import checkpoint_states, checkpoint_windows
from baton.engine.layers.norm import RMSNorm
from baton.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.norm import rms_norm
from baton.kernels.selective_scan import selective_scan_pool, selective_state_update
from baton.kernels.verify_steps import token_rows, verify_by_steps

# The scan's chunk grid: where true states can be checkpointed (any multiple of it); the C and
# Triton scans emit states there at no other cost, the torch reference pads each prefill to it.
MAMBA1_CHUNK_SIZE = 64

BCDtNorm = Literal["weighted", "weightless", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Mamba1Config:
    """One Mamba1 mixer, as each family reads its keys."""

    intermediate: int  # d_inner = expand x hidden_size
    state_size: int  # d_state
    conv_kernel: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool  # in_proj's and out_proj's
    bcdt_norm: BCDtNorm  # Jamba: weighted; Falcon-Mamba: weightless; Mamba: none
    norm_eps: float
    chunk_size: int
    cache_dtype: str  # of the SSM state
    what: str  # the config keys d_inner comes from, for the error refusing a TP size


class Mamba1Mixer(nn.Module):
    @staticmethod
    def state_spec(config: Mamba1Config, dtype: torch.dtype) -> LayerState:
        """The last K-1 conv inputs (model dtype) and the (d_inner, d_state) SSM state
        (`cache_dtype`), per slot, both kept at checkpoints; split by channels under TP."""
        channels = TPSplit(
            dim=0,
            segments=(
                Segment(
                    atoms=config.intermediate, atom_units=1, replicate_below=False, what=config.what
                ),
            ),
        )
        return LayerState(
            kind="mamba1",
            tensors=(
                StateTensor(
                    name="conv",
                    kind="slot",
                    shape=(config.intermediate, config.conv_kernel - 1),
                    dtype=dtype,
                    split=channels,
                    checkpointed=True,
                ),
                StateTensor(
                    name="ssm",
                    kind="slot",
                    shape=(config.intermediate, config.state_size),
                    dtype=getattr(torch, config.cache_dtype),
                    split=channels,
                    checkpointed=True,
                ),
            ),
            chunk_size=config.chunk_size,
            window_width=config.conv_kernel,
            page_window=None,
        )

    def __init__(self, hidden_size: int, config: Mamba1Config, index: int):
        super().__init__()
        self.tp = tp = parallel.current()
        first, width = parallel.split_evenly(config.intermediate, tp, config.what)
        self.index = index
        self.width = width
        self.d_state = config.state_size
        self.dt_rank = config.dt_rank
        self.bcdt_norm = config.bcdt_norm
        self.eps = config.norm_eps
        self.in_proj = nn.Linear(hidden_size, 2 * width, bias=config.proj_bias)
        self.conv1d = nn.Conv1d(
            width,
            width,
            config.conv_kernel,
            groups=width,
            bias=config.conv_bias,
            padding=config.conv_kernel - 1,
        )
        self.x_proj = nn.Linear(width, self.dt_rank + 2 * self.d_state, bias=False)
        # dt_proj's bias is added inside the matmul (transformers adds it in the scan: the same
        # sum, rounded once)
        self.dt_proj = nn.Linear(self.dt_rank, width, bias=True)
        self.A_log = nn.Parameter(torch.zeros(width, self.d_state))
        self.D = nn.Parameter(torch.ones(width))
        self.out_proj = nn.Linear(width, hidden_size, bias=config.proj_bias)
        if self.bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(self.dt_rank, self.eps)
            self.b_layernorm = RMSNorm(self.d_state, self.eps)
            self.c_layernorm = RMSNorm(self.d_state, self.eps)
        self.A: torch.Tensor | None = None  # float32 -exp(A_log), cached by freeze()
        if tp.size > 1:
            self.shard_parameters(config.intermediate, first)

    def shard_parameters(self, intermediate: int, first: int) -> None:
        mine = ((first, self.width),)
        rows = parallel.Slices(dim=0, ranges=mine)
        x_and_z = parallel.Slices(dim=0, ranges=(mine[0], (intermediate + first, self.width)))
        parallel.shard(self.in_proj.weight, x_and_z)
        parallel.shard(self.in_proj.bias, x_and_z)
        for param in (
            self.conv1d.weight,
            self.conv1d.bias,
            self.dt_proj.weight,
            self.dt_proj.bias,
            self.A_log,
            self.D,
        ):
            parallel.shard(param, rows)
        columns = parallel.Slices(dim=1, ranges=mine)
        parallel.shard(self.x_proj.weight, columns)
        parallel.shard(self.out_proj.weight, columns)
        parallel.shard(self.out_proj.bias, parallel.FirstRankOnly(rank=self.tp.rank))

    def freeze(self) -> None:
        self.A = None
        self.A = self.decay_rates()

    def decay_rates(self) -> torch.Tensor:
        return self.A if self.A is not None else -torch.exp(self.A_log.float())

    def norm(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.bcdt_norm == "weighted":
            return getattr(self, f"{name}_layernorm")(t)
        if self.bcdt_norm == "weightless":
            return rms_norm(t, torch.ones(t.shape[-1], device=t.device), self.eps)
        return t

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation: kernels/verify_steps.py), then
        prefill rows."""
        nd = md.forward.batch.num_decode_tokens
        nv, T = md.forward.batch.num_verify_tokens, hidden.shape[0]
        n = nd + nv  # prefill rows start here
        state = cache.layer("mamba1", self.index)
        conv_pool, ssm_pool = state["conv"], state["ssm"]
        x, z = self.in_proj(hidden).split(self.width, dim=-1)
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        parts, windows = [], None
        if nd:
            parts.append(causal_conv1d_update(x[:nd], weight, bias, conv_pool, md.decode_slots))
        if nv:
            xv, q = x[nd:n], md.verify_slots.shape[1] - 1
            parts.append(
                verify_by_steps(
                    md.verify_slots,
                    (conv_pool,),
                    lambda i, dst: causal_conv1d_update(
                        token_rows(xv, i, q), weight, bias, conv_pool, dst
                    ),
                )
            )
        if T > n:
            window_tokens = (
                md.track_window_indices[md.num_decode_tracks :] if md.has_mamba_track_mask else None
            )
            conv, windows = causal_conv1d_varlen(
                x[n:], weight, bias, conv_pool, md.prefill_slots, md.window_layout, window_tokens
            )
            parts.append(conv)
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        dbc = self.tp.all_reduce(self.x_proj(x))
        dt, B, C = dbc.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_proj(self.norm("dt", dt))
        B, C = self.norm("b", B), self.norm("c", C)
        A = self.decay_rates()
        no_bias = torch.zeros(self.width, device=x.device)
        ys, chunk_states = [], None
        if nd:
            ys.append(
                selective_state_update(
                    ssm_pool,
                    x[:nd],
                    dt[:nd],
                    A,
                    B[:nd],
                    C[:nd],
                    self.D,
                    no_bias,
                    z[:nd],
                    md.decode_slots,
                )  # fmt: skip
            )
        if nv:
            q = md.verify_slots.shape[1] - 1

            def scan_token(i: int, dst: torch.Tensor) -> torch.Tensor:
                xi, dti, Bi, Ci, zi = (token_rows(t[nd:n], i, q) for t in (x, dt, B, C, z))
                return selective_state_update(
                    ssm_pool, xi, dti, A, Bi, Ci, self.D, no_bias, zi, dst
                )

            ys.append(verify_by_steps(md.verify_slots, (ssm_pool,), scan_token))
        if T > n:
            y, chunk_states = selective_scan_pool(
                x[n:], dt[n:], A, B[n:], C[n:], self.D, no_bias, z[n:], ssm_pool,
                md.prefill_slots, md.chunk_layout, want_chunk_states=md.has_mamba_track_mask,
            )  # fmt: skip
            ys.append(y)
        if md.has_mamba_track_mask:
            checkpoint_states(md, ssm_pool, chunk_states)
            checkpoint_windows(md, conv_pool, windows)
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return self.tp.all_reduce(self.out_proj(y))
