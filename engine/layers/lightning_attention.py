"""MiniMax's lightning attention as an engine layer (`self_attn` of its linear-attention layers):

    q | k | v = act(qkv_proj(x))        per head [q_h | k_h | v_h] (head_dim each), act = SiLU
    o = lightning(q, k, v)              kernels/lightning.py: S = g S + k^T v, o = q S per head
    out = out_proj(sigmoid(output_gate(x)) * norm(o))

`norm` is an RMS norm over the whole (heads x head_dim) output with eps 1e-6 (transformers builds
MiniMaxRMSNorm with its default eps, not `rms_norm_eps`). The decay rate of head h in layer l of
n is transformers' slope rate: (2 ** (-8 / H)) ** (h + 1) * (1 - l / (n - 1 + 1e-5) + 1e-5); the
checkpoint's stored buffers (`slope_rate`, `query_decay`, `key_decay`, `diagonal_decay`) are
that formula's values and are not read. The state is (heads, head_dim, head_dim) float32 per
slot (transformers keeps it in the model dtype: equal in float32).

Under tensor parallelism the heads are split: qkv_proj's rows (a head's q, k and v are adjacent),
output_gate's rows, the norm's weight and out_proj's columns follow them, the decay rates too; the
norm's mean of squares is all-reduced (it spans every head), out_proj's output too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.checkpoints import checkpoint_states
from baton.kernels.lightning import (
    lightning_decode,
    lightning_layer_decode,
    lightning_prefill_pool,
)
from baton.kernels.verify_steps import token_rows, verify_by_steps

# The prefill's chunk grid (no config key; transformers' `block_size` only cuts its own loop):
# prefix checkpoints sit on multiples of it.
LIGHTNING_CHUNK_SIZE = 64
NORM_EPS = 1e-6  # MiniMaxRMSNorm's default: transformers passes no eps to the output norm


@dataclass(frozen=True, kw_only=True, slots=True)
class LightningConfig:
    num_heads: int
    head_dim: int
    num_layers: int  # of the model: the decay rates depend on the layer's depth


def decay_rates(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """(num_heads,) float32 lambda, as transformers' MiniMaxLightningAttention.get_slope_rate."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads) + 1
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base**exponent) * factor


class LightningAttention(nn.Module):
    @staticmethod
    def state_spec(config: LightningConfig, dtype: torch.dtype) -> LayerState:
        """The (heads, dk, dv) state in float32 per slot, kept at checkpoints, split by head."""
        return LayerState(
            kind="lightning",
            tensors=(
                StateTensor(
                    name="recurrent",
                    kind="slot",
                    shape=(config.num_heads, config.head_dim, config.head_dim),
                    dtype=torch.float32,
                    split=TPSplit(
                        dim=0,
                        segments=(
                            Segment(
                                atoms=config.num_heads,
                                atom_units=1,
                                replicate_below=False,
                                what="num_attention_heads",
                            ),
                        ),
                    ),
                    checkpointed=True,
                ),
            ),
            chunk_size=LIGHTNING_CHUNK_SIZE,
            window_width=None,
            page_window=None,
        )

    def __init__(self, hidden_size: int, config: LightningConfig, layer: int, index: int):
        """layer: the model layer's index (its decay rates); index: its pool index."""
        super().__init__()
        self.tp = tp = parallel.current()
        first, heads = parallel.split_evenly(config.num_heads, tp, "num_attention_heads")
        d = config.head_dim
        self.index, self.heads, self.head_dim = index, heads, d
        self.total_width = config.num_heads * d
        self.qkv_proj = nn.Linear(hidden_size, 3 * heads * d, bias=False)
        self.output_gate = nn.Linear(hidden_size, heads * d, bias=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(heads * d))
        self.out_proj = nn.Linear(heads * d, hidden_size, bias=False)
        self.decay = decay_rates(config.num_heads, layer, config.num_layers)[first : first + heads]
        if tp.size > 1:
            parallel.shard(
                self.qkv_proj.weight,
                parallel.Slices(dim=0, ranges=((3 * first * d, 3 * heads * d),)),
            )
            rows = ((first * d, heads * d),)
            parallel.shard(self.output_gate.weight, parallel.Slices(dim=0, ranges=rows))
            parallel.shard(self.norm.weight, parallel.Slices(dim=0, ranges=rows))
            parallel.shard(self.out_proj.weight, parallel.Slices(dim=1, ranges=rows))

    def output_norm(self, o: torch.Tensor) -> torch.Tensor:
        """RMS norm over every head's output (all ranks' heads under TP); MiniMaxRMSNorm
        rounds to the input dtype before the weight."""
        of = o.float()
        squares = of.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        normed = (of * torch.rsqrt(squares / self.total_width + NORM_EPS)).to(o.dtype)
        return self.norm.weight * normed

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation: kernels/verify_steps.py), then
        prefill rows. A step of decode rows only on one rank runs as one fused kernel where
        there is one (kernels/lightning.py's lightning_layer_decode)."""
        batch = md.forward.batch
        nd, T = batch.num_decode_tokens, x.shape[0]
        n = nd + batch.num_verify_tokens
        pool = cache.layer("lightning", self.index)["recurrent"]
        projected = self.qkv_proj(x)
        decay = self.decay.to(x.device)
        gate = None
        if nd == T and self.tp.size == 1:  # a decode step: one fused kernel where one runs it
            gate = self.output_gate(x)
            out = lightning_layer_decode(
                projected, gate, self.norm.weight, decay, pool, md.decode_slots, NORM_EPS
            )
            if out is not None:
                if md.has_mamba_track_mask:
                    checkpoint_states(md, pool, None)
                return self.out_proj(out)
        qkv = F.silu(projected).view(T, self.heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        parts, chunk_states = [], None
        if nd:
            parts.append(lightning_decode(q[:nd], k[:nd], v[:nd], decay, pool, md.decode_slots))
        if n > nd:
            steps = md.verify_slots.shape[1] - 1
            qv, kv, vv = q[nd:n], k[nd:n], v[nd:n]
            parts.append(
                verify_by_steps(
                    md.verify_slots,
                    (pool,),
                    lambda i, dst: lightning_decode(
                        token_rows(qv, i, steps),
                        token_rows(kv, i, steps),
                        token_rows(vv, i, steps),
                        decay,
                        pool,
                        dst,
                    ),  # fmt: skip
                )
            )
        if T > n:
            scan = lightning_prefill_pool(
                q[n:], k[n:], v[n:], decay, pool, md.prefill_slots, md.chunk_layout
            )
            parts.append(scan.out)
            chunk_states = scan.chunk_states
        if md.has_mamba_track_mask:
            checkpoint_states(md, pool, chunk_states)
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        gate = self.output_gate(x) if gate is None else gate
        out = torch.sigmoid(gate) * self.output_norm(o.reshape(T, -1))
        return self.tp.all_reduce(self.out_proj(out))
