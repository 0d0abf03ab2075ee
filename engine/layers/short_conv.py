"""LFM2's gated short convolution: in_proj -> [B | C | x]; a depthwise causal conv over B * x with
no activation (and, in the published models, no bias); the output gate C; out_proj. Parameter
names are transformers' (`in_proj`, `conv`, `out_proj`). Its only state is the conv window, the
last K-1 inputs per channel: kernels/conv1d.py runs it (activation "none").

Under tensor parallelism the hidden channels are split evenly: in_proj's B, C and x rows, the
conv and out_proj's columns follow them; out_proj's partial sums are all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.checkpoints import checkpoint_windows
from baton.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.verify_steps import token_rows, verify_by_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class ShortConvConfig:
    channels: int  # hidden_size
    conv_kernel: int  # LFM2's conv_L_cache
    bias: bool  # of in_proj, the conv and out_proj (LFM2's conv_bias)


class ShortConv(nn.Module):
    @staticmethod
    def state_spec(config: ShortConvConfig, dtype: torch.dtype) -> LayerState:
        """The last K-1 conv inputs per channel (model dtype), kept at checkpoints; split by
        channels under TP. No scan: any position is a true state (no chunk grid)."""
        channels = TPSplit(
            dim=0,
            segments=(
                Segment(
                    atoms=config.channels, atom_units=1, replicate_below=False, what="hidden_size"
                ),
            ),
        )
        return LayerState(
            kind="short_conv",
            tensors=(
                StateTensor(
                    name="conv",
                    kind="slot",
                    shape=(config.channels, config.conv_kernel - 1),
                    dtype=dtype,
                    split=channels,
                    checkpointed=True,
                ),
            ),
            chunk_size=None,
            window_width=config.conv_kernel,
            page_window=None,
        )

    def __init__(self, config: ShortConvConfig, index: int):
        super().__init__()
        self.tp = tp = parallel.current()
        first, width = parallel.split_evenly(config.channels, tp, "hidden_size")
        self.index = index
        self.width = width
        hidden, K = config.channels, config.conv_kernel
        self.in_proj = nn.Linear(hidden, 3 * width, bias=config.bias)
        self.conv = nn.Conv1d(width, width, K, groups=width, bias=config.bias, padding=K - 1)
        self.out_proj = nn.Linear(width, hidden, bias=config.bias)
        if tp.size > 1:
            mine = parallel.Slices(dim=0, ranges=((first, width),))
            bcx = parallel.Slices(
                dim=0, ranges=tuple((part * hidden + first, width) for part in range(3))
            )
            parallel.shard(self.in_proj.weight, bcx)
            parallel.shard(self.in_proj.bias, bcx)
            parallel.shard(self.conv.weight, mine)
            parallel.shard(self.conv.bias, mine)
            parallel.shard(self.out_proj.weight, parallel.Slices(dim=1, ranges=mine.ranges))
            parallel.shard(self.out_proj.bias, parallel.FirstRankOnly(rank=tp.rank))

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation: kernels/verify_steps.py), then
        prefill rows."""
        nd = md.forward.batch.num_decode_tokens
        n = nd + md.forward.batch.num_verify_tokens  # prefill rows start here
        conv_pool = cache.layer("short_conv", self.index)["conv"]
        B, C, x = self.in_proj(hidden).split(self.width, dim=-1)
        u = B * x
        weight, bias = self.conv.weight.squeeze(1), self.conv.bias
        parts, windows = [], None
        if nd:
            parts.append(
                causal_conv1d_update(
                    u[:nd], weight, bias, conv_pool, md.decode_slots, activation="none"
                )
            )
        if n > nd:
            uv, q = u[nd:n], md.verify_slots.shape[1] - 1
            parts.append(
                verify_by_steps(
                    md.verify_slots,
                    (conv_pool,),
                    lambda i, dst: causal_conv1d_update(
                        token_rows(uv, i, q), weight, bias, conv_pool, dst, activation="none"
                    ),
                )
            )
        if hidden.shape[0] > n:
            window_tokens = (
                md.track_window_indices[md.num_decode_tracks :] if md.has_mamba_track_mask else None
            )
            out, windows = causal_conv1d_varlen(
                u[n:], weight, bias, conv_pool, md.prefill_slots, md.window_layout,
                window_tokens, activation="none",
            )  # fmt: skip
            parts.append(out)
        if md.has_mamba_track_mask:
            checkpoint_windows(md, conv_pool, windows)
        conv = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.tp.all_reduce(self.out_proj(C * conv))
