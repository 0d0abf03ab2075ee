"""Griffin's recurrent block (RecurrentGemma's `temporal_block` in its recurrent layers):

    y = act(linear_y(x))                         the gate branch (gelu, tanh approximation)
    u = conv_1d(linear_x(x))                     depthwise causal conv with bias, no activation
    h = rg_lru(u)                                the RG-LRU (kernels/rglru.py)
    out = linear_out(h * y)

Parameter names are transformers' (`linear_x`, `linear_y`, `linear_out`, `conv_1d`,
`rg_lru.{recurrent_param, input_gate_weight, input_gate_bias, recurrent_gate_weight,
recurrent_gate_bias}`). The state is the conv window (the last K-1 outputs of linear_x, model
dtype) and the LRU state (width,) in float32, both per slot.

Under tensor parallelism the LRU width is split by the config's heads (`num_attention_heads`:
the gates are block-diagonal, one (bw, bw) block per head, so a rank's channels need no other
rank's): linear_x / linear_y rows, the conv, the LRU parameters and the states follow;
linear_out is row-parallel, its output all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.mlp import ACTIVATIONS, fuse_for_cpu
from baton.engine.layers.track import checkpoint_states
from baton.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.cpu import rglru as cpu_rglru
from baton.kernels.rglru import (
    RGLRUWeights,
    rglru_inputs,
    rglru_scan_pool,
    rglru_update,
)
from baton.kernels.verify_steps import token_rows, verify_by_steps

# The prefill scan's chunk grid (no config key): any position is a true state, the grid only
# says where prefix checkpoints sit, so a track interval must be a multiple of it.
RGLRU_CHUNK_SIZE = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class RGLRUConfig:
    hidden_size: int
    width: int  # lru_width
    num_heads: int  # the gates' blocks (num_attention_heads)
    conv_kernel: int  # conv1d_width
    activation: str  # of the gate branch: transformers' hidden_activation


class RecurrentBlock(nn.Module):
    @staticmethod
    def state_spec(config: RGLRUConfig, dtype: torch.dtype) -> LayerState:
        """The last K-1 inputs of the conv (model dtype) and the LRU state (width,) in float32,
        per slot, both kept at checkpoints; under TP both split by the gates' heads."""
        heads = TPSplit(
            dim=0,
            segments=(
                Segment(
                    atoms=config.num_heads,
                    atom_units=config.width // config.num_heads,
                    replicate_below=False,
                    what="num_attention_heads",
                ),
            ),
        )
        return LayerState(
            kind="rglru",
            tensors=(
                StateTensor(
                    name="conv",
                    kind="slot",
                    shape=(config.width, config.conv_kernel - 1),
                    dtype=dtype,
                    split=heads,
                    checkpointed=True,
                ),
                StateTensor(
                    name="recurrent",
                    kind="slot",
                    shape=(config.width,),
                    dtype=torch.float32,
                    split=heads,
                    checkpointed=True,
                ),
            ),
            chunk_size=RGLRU_CHUNK_SIZE,
            window_width=config.conv_kernel,
            page_window=None,
        )

    def __init__(self, config: RGLRUConfig, index: int):
        super().__init__()
        self.tp = tp = parallel.current()
        first_head, heads = parallel.split_evenly(config.num_heads, tp, "num_attention_heads")
        bw = config.width // config.num_heads
        width, first = heads * bw, first_head * bw
        self.index, self.width = index, width
        self.act = ACTIVATIONS[config.activation]
        hidden, K = config.hidden_size, config.conv_kernel
        self.linear_y = nn.Linear(hidden, width)
        self.linear_x = nn.Linear(hidden, width)
        self.linear_out = nn.Linear(width, hidden)
        self.conv_1d = nn.Conv1d(width, width, K, groups=width, padding=K - 1)
        self.rg_lru = nn.Module()
        self.rg_lru.recurrent_param = nn.Parameter(torch.zeros(width))
        for name in ("input_gate", "recurrent_gate"):
            setattr(self.rg_lru, f"{name}_weight", nn.Parameter(torch.zeros(heads, bw, bw)))
            setattr(self.rg_lru, f"{name}_bias", nn.Parameter(torch.zeros(heads, bw)))
        if tp.size > 1:
            rows = parallel.Slices(dim=0, ranges=((first, width),))
            by_head = parallel.Slices(dim=0, ranges=((first_head, heads),))
            for linear in (self.linear_x, self.linear_y):
                parallel.shard(linear.weight, rows)
                parallel.shard(linear.bias, rows)
            parallel.shard(self.conv_1d.weight, rows)
            parallel.shard(self.conv_1d.bias, rows)
            parallel.shard(self.rg_lru.recurrent_param, rows)
            for name in ("input_gate", "recurrent_gate"):
                parallel.shard(getattr(self.rg_lru, f"{name}_weight"), by_head)
                parallel.shard(getattr(self.rg_lru, f"{name}_bias"), by_head)
            parallel.shard(self.linear_out.weight, parallel.Slices(dim=1, ranges=rows.ranges))
            parallel.shard(self.linear_out.bias, parallel.FirstRankOnly(rank=tp.rank))
        self.decode_params: cpu_rglru.RGLRUDecodeParams | None = None  # CPU: freeze()
        self.yx_proj: nn.Module | None = None  # CPU: linear_y and linear_x in one matmul

    def pack_for_cpu(self) -> None:
        """[y | x] as one prepacked matmul (the two linears are dropped), unless they are
        stored differently (mixed precision)."""
        self.yx_proj = fuse_for_cpu([self.linear_y, self.linear_x])
        if self.yx_proj is not None:
            del self.linear_y, self.linear_x

    def freeze(self) -> None:
        """The fused C decode step's float32 copies of the conv and LRU parameters (CPU, after
        loading)."""
        self.decode_params = cpu_rglru.RGLRUDecodeParams.of(
            self.conv_1d.weight.squeeze(1), self.conv_1d.bias, self.lru_weights()
        )

    def lru_weights(self) -> RGLRUWeights:
        lru = self.rg_lru
        return RGLRUWeights(
            recurrent_param=lru.recurrent_param,
            input_gate_weight=lru.input_gate_weight,
            input_gate_bias=lru.input_gate_bias,
            recurrent_gate_weight=lru.recurrent_gate_weight,
            recurrent_gate_bias=lru.recurrent_gate_bias,
        )

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation: kernels/verify_steps.py), then
        prefill rows."""
        batch = md.forward.batch
        nd, T = batch.num_decode_tokens, hidden.shape[0]
        n = nd + batch.num_verify_tokens  # prefill rows start here
        state = cache.layer("rglru", self.index)
        conv_pool, lru_pool = state["conv"], state["recurrent"]
        if self.yx_proj is not None:
            y, x = self.yx_proj(hidden).split(self.width, dim=-1)
        else:
            y, x = self.linear_y(hidden), self.linear_x(hidden)
        gate = self.act(y)
        weight, bias = self.conv_1d.weight.squeeze(1), self.conv_1d.bias
        weights = self.lru_weights()
        positions = batch.positions
        parts, windows, chunk_states = [], None, None
        if (
            nd
            and self.decode_params is not None
            and cpu_rglru.decode_supported(x, conv_pool, lru_pool)
        ):
            parts.append(
                cpu_rglru.rglru_decode_cpu(
                    x[:nd], conv_pool, lru_pool, md.decode_slots, self.decode_params
                )
            )
        elif nd:
            conv = causal_conv1d_update(
                x[:nd], weight, bias, conv_pool, md.decode_slots, activation="none"
            )
            a, u = rglru_inputs(conv, positions[:nd], weights)
            parts.append(rglru_update(a, u, lru_pool, md.decode_slots))
        if n > nd:
            q = md.verify_slots.shape[1] - 1
            xv, pv = x[nd:n], positions[nd:n]

            def step(i: int, dst: torch.Tensor) -> torch.Tensor:
                conv = causal_conv1d_update(
                    token_rows(xv, i, q), weight, bias, conv_pool, dst, activation="none"
                )
                a, u = rglru_inputs(conv, token_rows(pv, i, q), weights)
                return rglru_update(a, u, lru_pool, dst)

            parts.append(verify_by_steps(md.verify_slots, (conv_pool, lru_pool), step))
        if T > n:
            track = md.has_mamba_track_mask
            conv, windows = causal_conv1d_varlen(
                x[n:], weight, bias, conv_pool, md.prefill_slots, md.window_layout,
                md.track_window_indices[md.num_decode_tracks :] if track else None,
                activation="none",
            )  # fmt: skip
            a, u = rglru_inputs(conv, positions[n:], weights)
            scan = rglru_scan_pool(a, u, lru_pool, md.prefill_slots, md.chunk_layout)
            parts.append(scan.y)
            chunk_states = scan.chunk_states
        if md.has_mamba_track_mask:
            checkpoint_states(md, conv_pool, lru_pool, windows, chunk_states)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.tp.all_reduce(self.linear_out(out * gate))
