"""The Mamba2 mixer every family shares: in_proj -> [z | xBC | dt]; causal conv1d + SiLU on xBC;
SSD scan (prefill) or selective state update (decode); the gate; out_proj. Parameter names are
transformers' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm.weight`, `out_proj`).

Family variants are parameters, not copies (Mamba2Config):
  norm              "gated": norm(y * silu(z)) in groups of intermediate / n_groups;
                    "norm_then_gate": norm(y) * silu(z); "none": y * silu(z), no norm weight
  in_multiplier     the input is scaled before in_proj (Falcon-H1)
  multipliers       in_proj's [z | x | B | C | dt] segments are scaled (Falcon-H1's mup_vector)

Under tensor parallelism the in_proj rows and conv channels are segments with different split
rules (vLLM's mamba_v2_sharded_weight_loader follows the same layout):

    in_proj rows:   z (I) | x (I) | B (G*N) | C (G*N) | dt (H)     I = H * head_dim
    conv channels:          x (I) | B (G*N) | C (G*N)

z, x, dt and the conv's x channels follow the heads; B and C follow the groups: split when
n_groups divides by the size, replicated whole on every rank when n_groups == 1 (then the
gated norm's single group spans the ranks and its variance is all-reduced). The state spec
(`Mamba2Mixer.state_spec`) splits the conv window and SSM state the same way.
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
from baton.engine.layers.track import checkpoint_states
from baton.engine.parallel import TensorParallel
from baton.kernels.conv1d import (
    causal_conv1d_update,
    causal_conv1d_update_multi,
    causal_conv1d_varlen,
)
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.cpu.verify import mamba_verify_cpu, mamba_verify_supported
from baton.kernels.norm import gated_rms_norm, group_rms_norm
from baton.kernels.ssd import ssd_scan_pool
from baton.kernels.ssu import selective_state_update, selective_state_update_multi

MambaNorm = Literal["gated", "norm_then_gate", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Config:
    """One Mamba2 mixer, as every family reads its keys (engine/models/hybrid.py)."""

    num_heads: int
    head_dim: int
    state_size: int  # d_state
    n_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool  # in_proj's bias
    out_proj_bias: bool  # out_proj's: the in_proj key, but Falcon-H1's `projectors_bias`
    time_step_limit: tuple[float, float]
    # "gated": norm(y * silu(z)) per group (NemotronH, Bamba, Granite, Falcon-H1 with
    # mamba_norm_before_gate=False); "norm_then_gate": norm(y) * silu(z); "none": y * silu(z).
    norm: MambaNorm
    norm_eps: float  # the model's, but transformers' Zamba2 mixer hard-codes 1e-5
    cache_dtype: str  # of the SSM state (`mamba_ssm_cache_dtype`)
    in_multiplier: float  # Falcon-H1's ssm_in_multiplier (1.0 elsewhere)
    multipliers: tuple[float, float, float, float, float]  # Falcon-H1's mup_vector segments

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size


Ranges = tuple[tuple[int, int], ...]  # (start, length) along one dim of the full tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaShard:
    first_head: int
    num_heads: int
    first_group: int
    num_groups: int
    norm_across_ranks: bool  # one group replicated on every rank: the norm all-reduces
    in_proj_rows: Ranges  # z | x | B | C | dt, in that order
    conv_channels: Ranges  # x | B | C


def mamba_shard(config: Mamba2Config, tp: TensorParallel) -> MambaShard:
    """What rank `tp` holds of the mixer (the layout in the module docstring)."""
    head_dim, d_state = config.head_dim, config.state_size
    inter, gn = config.intermediate, config.n_groups * config.state_size
    h0, heads = parallel.split_evenly(config.num_heads, tp, "mamba_num_heads")
    g0, groups = parallel.mamba_group_part(config.n_groups, tp)
    x = (h0 * head_dim, heads * head_dim)
    b = (g0 * d_state, groups * d_state)
    c = (gn + g0 * d_state, groups * d_state)
    return MambaShard(
        first_head=h0,
        num_heads=heads,
        first_group=g0,
        num_groups=groups,
        norm_across_ranks=tp.size > 1 and config.n_groups == 1 and config.norm != "none",
        in_proj_rows=(
            x,
            (inter + x[0], x[1]),
            (2 * inter + b[0], b[1]),
            (2 * inter + c[0], c[1]),
            (2 * inter + 2 * gn + h0, heads),
        ),
        conv_channels=(x, (inter + b[0], b[1]), (inter + c[0], c[1])),
    )


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; causal conv1d + SiLU on xBC; SSD scan (prefill) or selective
    state update (decode); gated RMSNorm norm(y * silu(z)); out_proj."""

    @staticmethod
    def state_spec(config: Mamba2Config, dtype: torch.dtype) -> LayerState:
        """The last K-1 inputs of the conv over x | B | C (model dtype) and the SSM state
        (`mamba_ssm_cache_dtype`), per slot, both kept at checkpoints. Under TP the conv
        channels split as x by heads, B and C by groups (one group: replicated), the SSM state
        by heads (engine/parallel/support.py slices the weights the same way)."""
        heads, groups = config.num_heads, config.n_groups
        x = Segment(
            atoms=heads, atom_units=config.head_dim, replicate_below=False, what="mamba_num_heads"
        )
        bc = Segment(
            atoms=groups, atom_units=config.state_size, replicate_below=groups == 1, what="n_groups"
        )
        by_heads = Segment(atoms=heads, atom_units=1, replicate_below=False, what="mamba_num_heads")
        return LayerState(
            kind="mamba2",
            tensors=(
                StateTensor(
                    name="conv",
                    kind="slot",
                    shape=(config.conv_dim, config.conv_kernel - 1),
                    dtype=dtype,
                    split=TPSplit(dim=0, segments=(x, bc, bc)),
                    checkpointed=True,
                ),
                StateTensor(
                    name="ssm",
                    kind="slot",
                    shape=(heads, config.head_dim, config.state_size),
                    dtype=getattr(torch, config.cache_dtype),
                    split=TPSplit(dim=0, segments=(by_heads,)),
                    checkpointed=True,
                ),
            ),
            chunk_size=config.chunk_size,
            window_width=config.conv_kernel,
            page_window=None,
        )

    def __init__(self, hidden_size: int, config: Mamba2Config, mamba_index: int):
        super().__init__()
        # Under tensor parallelism this rank holds its heads and groups (engine/parallel/support.py);
        # the norm's group size stays the model's, spanning the ranks when n_groups == 1.
        self.tp = tp = parallel.current()
        self.shard = mamba_shard(config, tp)
        self.mamba_index = mamba_index
        self.num_heads = H = self.shard.num_heads
        self.head_dim = config.head_dim
        self.n_groups = self.shard.num_groups
        self.d_state = config.state_size
        self.intermediate = H * self.head_dim
        self.conv_dim = self.intermediate + 2 * self.n_groups * self.d_state
        self.group_size = config.intermediate // config.n_groups
        self.eps = config.norm_eps
        self.dt_limit = config.time_step_limit
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate + self.conv_dim + H, bias=config.proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            config.conv_kernel,
            groups=self.conv_dim,
            bias=config.conv_bias,
            padding=config.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm_mode = config.norm
        if self.norm_mode != "none":
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(self.intermediate))
        self.in_multiplier = config.in_multiplier
        self.mup_vector: torch.Tensor | None = None
        if config.multipliers != (1.0,) * 5:
            gn = self.n_groups * self.d_state
            sizes = [self.intermediate, self.intermediate, gn, gn, H]
            self.mup_vector = torch.cat(
                [torch.full((n,), m) for n, m in zip(sizes, config.multipliers)]
            )
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=config.out_proj_bias)
        self.frozen: cpu_ops.MambaDecodeParams | None = None
        if tp.size > 1:
            self.shard_parameters()

    def shard_parameters(self) -> None:
        """Attach each parameter's slice of the checkpoint (column-parallel in, row-parallel
        out_proj whose bias rank 0 alone adds)."""
        rows = self.shard.in_proj_rows
        parallel.shard(self.in_proj.weight, parallel.Slices(dim=0, ranges=rows))
        parallel.shard(self.in_proj.bias, parallel.Slices(dim=0, ranges=rows))
        channels = parallel.Slices(dim=0, ranges=self.shard.conv_channels)
        parallel.shard(self.conv1d.weight, channels)
        parallel.shard(self.conv1d.bias, channels)
        heads = parallel.Slices(dim=0, ranges=((self.shard.first_head, self.num_heads),))
        for param in (self.dt_bias, self.A_log, self.D):
            parallel.shard(param, heads)
        width = rows[0]  # this rank's z rows: its heads' channels of the intermediate
        if self.norm_mode != "none":
            parallel.shard(self.norm.weight, parallel.Slices(dim=0, ranges=(width,)))
        parallel.shard(self.out_proj.weight, parallel.Slices(dim=1, ranges=(width,)))
        parallel.shard(self.out_proj.bias, parallel.FirstRankOnly(rank=self.tp.rank))

    def split_xbc(self, xbc: torch.Tensor):
        gn = self.n_groups * self.d_state
        x, B, C = xbc.split([self.intermediate, gn, gn], dim=-1)
        T = xbc.shape[0]
        return (
            x.reshape(T, self.num_heads, self.head_dim),
            B.reshape(T, self.n_groups, self.d_state),
            C.reshape(T, self.n_groups, self.d_state),
        )

    def decode_params(self) -> cpu_ops.MambaDecodeParams:
        """Float32 forms of the small parameters the fused CPU decode step reads; cached by
        `freeze()` once the weights are loaded and cast."""
        if self.frozen is not None:
            return self.frozen
        bias = self.conv1d.bias
        return cpu_ops.MambaDecodeParams(
            conv_weight=self.conv1d.weight.squeeze(1).float().contiguous(),
            conv_bias=(
                bias.float().contiguous()
                if bias is not None
                else torch.zeros(self.conv_dim, device=self.conv1d.weight.device)
            ),
            dt_bias=self.dt_bias.float().contiguous(),
            A=-torch.exp(self.A_log.float()),
            D=self.D.float().contiguous(),
            norm_weight=(
                self.norm.weight.float().contiguous()
                if self.norm_mode != "none"
                else torch.ones(self.intermediate, device=self.D.device)
            ),
        )

    def freeze(self) -> None:
        self.frozen = None
        self.frozen = self.decode_params()

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation), then prefill rows; each part ends
        gated-normed (row-wise)."""
        T = hidden.shape[0]
        nd = md.forward.batch.num_decode_tokens
        nv = md.forward.batch.num_verify_tokens
        state = cache.layer("mamba2", self.mamba_index)
        conv_pool, ssm_pool = state["conv"], state["ssm"]
        if self.in_multiplier != 1.0:
            hidden = hidden * self.in_multiplier
        zxbcdt = self.in_proj(hidden)
        if self.mup_vector is not None:
            zxbcdt = zxbcdt * self.mup_vector.to(device=zxbcdt.device, dtype=zxbcdt.dtype)
        parts = []
        windows = chunk_states = None
        if nd:
            parts.append(self.decode(zxbcdt[:nd], md, conv_pool, ssm_pool))
        if nv:
            parts.append(self.verify(zxbcdt[nd : nd + nv], md, conv_pool, ssm_pool))
        if T > nd + nv:
            normed, windows, chunk_states = self.extend(zxbcdt[nd + nv :], md, conv_pool, ssm_pool)
            parts.append(normed)
        if md.has_mamba_track_mask:
            self.checkpoint(md, conv_pool, ssm_pool, windows, chunk_states)
        return self.tp.all_reduce(self.out_proj(parts[0] if len(parts) == 1 else torch.cat(parts)))

    def decode(self, zxbcdt, md: Mamba2Metadata, conv_pool, ssm_pool) -> torch.Tensor:
        # A norm spanning the ranks: the fused step gates only, the variance is all-reduced here
        # (norm_then_gate needs y before the gate: the torch path below).
        across = self.shard.norm_across_ranks
        fused_norm = "none" if across else self.norm_mode
        if (not across or self.norm_mode == "gated") and cpu_ops.mamba_decode_supported(
            zxbcdt, conv_pool, ssm_pool
        ):
            gated = cpu_ops.mamba_decode_cpu(
                zxbcdt,
                conv_pool,
                ssm_pool,
                md.decode_slots,
                self.decode_params(),
                self.dt_limit,
                self.eps,
                num_heads=self.num_heads,
                head_dim=self.head_dim,
                n_groups=self.n_groups,
                d_state=self.d_state,
                # (spanning the ranks, the norm is not the fused step's: one group of its width)
                norm_group=self.intermediate if across else self.group_size,
                norm_mode=fused_norm,
            )
            return self.rms_norm_across_ranks(gated.float(), gated.dtype) if across else gated
        z, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        xbc = causal_conv1d_update(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_pool, md.decode_slots
        )
        x, B, C = self.split_xbc(xbc)
        y = selective_state_update(
            ssm_pool,
            x,
            dt,
            -torch.exp(self.A_log.float()),
            B,
            C,
            self.D,
            self.dt_bias,
            md.decode_slots,
            self.dt_limit,
        )
        return self.gate(y, z)

    def verify(self, zxbcdt, md: Mamba2Metadata, conv_pool, ssm_pool) -> torch.Tensor:
        """Speculative verify: q tokens per request (rows request-major), the conv window and
        SSM state after each token kept in slot md.verify_slots[:, i + 1] (rollback is choosing
        one of them)."""
        slots = md.verify_slots  # (requests, q + 1)
        nv, q = slots.shape[0], slots.shape[1] - 1
        across = self.shard.norm_across_ranks
        if (not across or self.norm_mode == "gated") and mamba_verify_supported(
            zxbcdt, conv_pool, ssm_pool, q
        ):
            gated = mamba_verify_cpu(
                zxbcdt,
                conv_pool,
                ssm_pool,
                slots,
                self.decode_params(),
                self.dt_limit,
                self.eps,
                num_heads=self.num_heads,
                head_dim=self.head_dim,
                n_groups=self.n_groups,
                d_state=self.d_state,
                norm_group=self.intermediate if across else self.group_size,
                norm_mode="none" if across else self.norm_mode,
            )
            return self.rms_norm_across_ranks(gated.float(), gated.dtype) if across else gated
        z, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        xbc = causal_conv1d_update_multi(
            xbc.reshape(nv, q, self.conv_dim),
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            conv_pool,
            slots,
        ).reshape(nv * q, self.conv_dim)
        x, B, C = self.split_xbc(xbc)
        y = selective_state_update_multi(
            ssm_pool,
            x.view(nv, q, self.num_heads, self.head_dim),
            dt.reshape(nv, q, self.num_heads),
            -torch.exp(self.A_log.float()),
            B.view(nv, q, self.n_groups, self.d_state),
            C.view(nv, q, self.n_groups, self.d_state),
            self.D,
            self.dt_bias,
            slots,
            self.dt_limit,
        )
        return self.gate(y.reshape(nv * q, self.num_heads, self.head_dim), z)

    def extend(self, zxbcdt, md: Mamba2Metadata, conv_pool, ssm_pool):
        """Prefill chunks: varlen conv + SSD scan. Returns (normed rows, conv windows and chunk
        states at the track points, for checkpoints)."""
        z, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        window_tokens = (
            md.track_window_indices[md.num_decode_tracks :] if md.has_mamba_track_mask else None
        )
        xbc, windows = causal_conv1d_varlen(
            xbc,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            conv_pool,
            md.prefill_slots,
            md.window_layout,
            window_tokens,
        )
        x, B, C = self.split_xbc(xbc)
        y, chunk_states = ssd_scan_pool(
            x,
            dt,
            -torch.exp(self.A_log.float()),
            B,
            C,
            self.D,
            self.dt_bias,
            ssm_pool,
            md.prefill_slots,
            md.chunk_layout,
            self.dt_limit,
            want_chunk_states=md.has_mamba_track_mask,  # only checkpoints read them
        )
        return self.gate(y, z), windows, chunk_states

    def gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y.reshape(z.shape[0], self.intermediate)
        if self.shard.norm_across_ranks:
            silu_z = torch.nn.functional.silu(z.float())
            if self.norm_mode == "gated":
                return self.rms_norm_across_ranks(y.float() * silu_z, y.dtype)
            return (self.rms_norm_across_ranks(y.float(), torch.float32) * silu_z).to(z.dtype)
        if self.norm_mode == "gated":
            return gated_rms_norm(y, z, self.norm.weight, self.eps, self.group_size)
        if self.norm_mode == "norm_then_gate":
            normed = group_rms_norm(y, self.norm.weight, self.eps, self.group_size)
            return (normed * torch.nn.functional.silu(z.float())).to(z.dtype)
        return (y.float() * torch.nn.functional.silu(z.float())).to(z.dtype)

    def rms_norm_across_ranks(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """h: (T, local intermediate) float32. RMS-normalise over the whole intermediate, which
        the ranks hold in pieces (one group replicated): the sum of squares is all-reduced.
        Same rounding as baton.kernels.norm's gated norm: weight applied after casting to `dtype`."""
        squares = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(squares / self.group_size + self.eps)
        return self.norm.weight * h.to(dtype)

    def checkpoint(self, md, conv_pool, ssm_pool, windows, chunk_states) -> None:
        """Copy the conv window and SSM state at each track point into its checkpoint slot."""
        checkpoint_states(md, conv_pool, ssm_pool, windows, chunk_states)
