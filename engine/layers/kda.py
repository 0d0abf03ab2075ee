"""The Kimi Delta Attention mixer (Kimi Linear, Bailing hybrid) as an engine layer: its state
spec, its weights as the released checkpoints store them, TP sharding, and the forward over the
pools. The math is kernels/kda_mixer.py's (conv over q|k|v + SiLU, per-channel decay, the delta
rule, a sigmoid-gated norm).

Weights (`KDAConfig.projections`) of Kimi Linear (`self_attn.`), as its release and transformers'
save_pretrained write them:

    q_proj, k_proj, v_proj          (H d, hidden) each
    q_conv1d, k_conv1d, v_conv1d    (H d, 1, K): the one depthwise conv over q|k|v, cut in three
    f_a_proj (d, hidden), f_b_proj (H d, d), dt_bias (H d,), A_log (1, 1, H, 1): the decay
    b_proj (H, hidden)              the write strength beta
    g_a_proj (d, hidden), g_b_proj (H d, d), o_norm (d,): the output gate and norm
    o_proj (hidden, H d)

(transformers' in-memory names put f_a_proj, f_b_proj, dt_bias and A_log under `forget_gate.` and
join the three convs; its save_pretrained writes the names above.) Bailing hybrid's ("full_rank")
have one full-rank `f_proj` (H d, hidden) and `g_proj` (H d, hidden) instead of the a/b pairs,
A_log of shape (H,), and may bound the decay (`gate_lower_bound`: g = lb sigmoid(exp(A_log)
(f + dt_bias)), its `kda_safe_gate`). On the CPU the projections of x become one prepacked matmul
[q | k | v | f_a or f | b | g_a or g] (pack_for_cpu).

Under tensor parallelism a rank holds num_heads / size heads: q/k/v, f_b, g_b, b, dt_bias, A_log,
the conv channels and the state split by head (the state spec's split, which the slices here
are read from), f_a and g_a (rank d) replicated, o_proj row-parallel.
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
from baton.engine.layers.mlp import fuse_for_cpu
from baton.engine.layers.track import checkpoint_states
from baton.kernels.cpu.kda import KDADecodeParams
from baton.kernels.kda_mixer import (
    KDAMixerDims,
    KDAMixerWeights,
    kda_mixer_decode,
    kda_mixer_prefill,
    kda_mixer_verify,
)

# The chunk of KDA's prefill (no config key: FLA's and transformers' 64). Prefix checkpoints sit on
# multiples of it, so a family's track interval must be one.
KDA_CHUNK_SIZE = 64
KDAProjections = Literal["low_rank", "full_rank"]
# the linears of x, in the order of the CPU's one matmul
PROJECTIONS: dict[KDAProjections, tuple[str, ...]] = {
    "low_rank": ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj"),
    "full_rank": ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj"),
}
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


@dataclass(frozen=True, kw_only=True, slots=True)
class KDAConfig:
    """One KDA mixer, as a family reads its keys (Kimi's `linear_attn_config`)."""

    num_heads: int
    head_dim: int  # dk = dv
    conv_kernel: int
    norm_eps: float  # of the gated output norm (rms_norm_eps)
    # "low_rank": Kimi's f_a/f_b and g_a/g_b pairs, A_log (1, 1, H, 1); "full_rank": Bailing's
    # f_proj and g_proj, A_log (H,)
    projections: KDAProjections
    # None: g = -exp(A_log) softplus(f + dt_bias); else g = lb sigmoid(exp(A_log) (f + dt_bias))
    gate_lower_bound: float | None

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim


class KimiDeltaAttention(nn.Module):
    @staticmethod
    def state_spec(config: KDAConfig, dtype: torch.dtype) -> LayerState:
        """The last K-1 inputs of the conv over q | k | v (model dtype) and the recurrent state
        (heads, dk, dv) in float32 (as transformers keeps it), per slot, both kept at
        checkpoints; under TP both split by head (q, k and v segments of the conv alike)."""
        heads = Segment(
            atoms=config.num_heads,
            atom_units=config.head_dim,
            replicate_below=False,
            what="linear_attn_config.num_heads",
        )
        return LayerState(
            kind="kda",
            tensors=(
                StateTensor(
                    name="conv",
                    kind="slot",
                    shape=(3 * config.width, config.conv_kernel - 1),
                    dtype=dtype,
                    split=TPSplit(dim=0, segments=(heads, heads, heads)),
                    checkpointed=True,
                ),
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
                                what="linear_attn_config.num_heads",
                            ),
                        ),
                    ),  # fmt: skip
                    checkpointed=True,
                ),
            ),
            chunk_size=KDA_CHUNK_SIZE,
            window_width=config.conv_kernel,
            page_window=None,
        )

    def __init__(self, hidden_size: int, config: KDAConfig, index: int):
        """index: this layer's pool index among the model's KDA layers."""
        super().__init__()
        self.tp = tp = parallel.current()
        self.config, self.index = config, index
        conv = self.state_spec(config, torch.float32).tensors[0]
        (q0, qn), _, _ = conv.split.ranges(tp.size, tp.rank)
        d, K = config.head_dim, config.conv_kernel
        first, heads = q0 // d, qn // d
        width = heads * d
        self.dims = KDAMixerDims(
            num_heads=heads,
            head_dim=d,
            norm_eps=config.norm_eps,
            gate_lower_bound=config.gate_lower_bound,
        )
        by_head = parallel.Slices(dim=0, ranges=((q0, qn),))
        for name in ("q_proj", "k_proj", "v_proj"):
            self.add_module(name, nn.Linear(hidden_size, width, bias=False))
        for name in CONVS:
            self.add_module(name, nn.Conv1d(width, width, K, groups=width, bias=False))
        low_rank = config.projections == "low_rank"
        if low_rank:
            self.f_a_proj = nn.Linear(hidden_size, d, bias=False)
            self.f_b_proj = nn.Linear(d, width, bias=False)
            self.g_a_proj = nn.Linear(hidden_size, d, bias=False)
            self.g_b_proj = nn.Linear(d, width, bias=False)
        else:
            self.f_proj = nn.Linear(hidden_size, width, bias=False)
            self.g_proj = nn.Linear(hidden_size, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros((1, 1, heads, 1) if low_rank else (heads,)))
        self.b_proj = nn.Linear(hidden_size, heads, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(width, hidden_size, bias=False)
        self.projections = PROJECTIONS[config.projections]
        if tp.size > 1:
            by_rows = ("f_b_proj", "g_b_proj") if low_rank else ("f_proj", "g_proj")
            for name in ("q_proj", "k_proj", "v_proj", *CONVS, *by_rows):
                parallel.shard(getattr(self, name).weight, by_head)
            parallel.shard(self.dt_bias, by_head)
            heads_dim = 2 if low_rank else 0
            parallel.shard(self.A_log, parallel.Slices(dim=heads_dim, ranges=((first, heads),)))
            parallel.shard(self.b_proj.weight, parallel.Slices(dim=0, ranges=((first, heads),)))
            parallel.shard(self.o_proj.weight, parallel.Slices(dim=1, ranges=((q0, qn),)))
        self.in_proj: nn.Module | None = None  # CPU: the six projections of x in one matmul
        rank = d if low_rank else width
        self.in_proj_widths = [width, width, width, rank, heads, rank]
        self.frozen: tuple[KDAMixerWeights, KDADecodeParams] | None = None  # CPU: freeze()

    def pack_for_cpu(self) -> None:
        """[q | k | v | f_a or f | b | g_a or g] as one prepacked matmul (the six linears are
        dropped), unless they are stored differently (mixed precision)."""
        self.in_proj = fuse_for_cpu([getattr(self, n) for n in self.projections])
        if self.in_proj is not None:
            for name in self.projections:
                delattr(self, name)

    def freeze(self) -> None:
        """Cache the mixer's weights as the kernels read them and the fused decode step's
        float32 copies (CPU, after loading)."""
        self.frozen = None
        weights = self.mixer_weights()
        self.frozen = (weights, weights.decode_params())

    def mixer_weights(self) -> KDAMixerWeights:
        if self.frozen is not None:
            return self.frozen[0]
        return KDAMixerWeights(
            conv_weight=torch.cat([getattr(self, n).weight[:, 0] for n in CONVS]),
            A_log=self.A_log.view(-1),
            dt_bias=self.dt_bias,
            norm_weight=self.o_norm.weight,
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (T, hidden) -> qkv (T, 3 width), f (T, width), b (T, heads), gate (T, width)."""
        if self.in_proj is not None:
            q, k, v, f, b, g = self.in_proj(x).split(self.in_proj_widths, dim=-1)
        else:
            q, k, v, f, b, g = (getattr(self, n)(x) for n in self.projections)
        if self.config.projections == "low_rank":
            f, g = self.f_b_proj(f), self.g_b_proj(g)
        return torch.cat([q, k, v], dim=-1), f, b, g

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation), then prefill rows (the batch's
        order)."""
        state = cache.layer("kda", self.index)
        conv_pool, state_pool = state["conv"], state["recurrent"]
        qkv, f, b, gate = self.project(hidden)
        T, nd = hidden.shape[0], md.forward.batch.num_decode_tokens
        nv = md.forward.batch.num_verify_tokens
        weights, dims = self.mixer_weights(), self.dims
        params = self.frozen[1] if self.frozen is not None else None
        parts, windows, chunk_states = [], None, None
        if nd:
            rows = [t[:nd] for t in (qkv, f, b, gate)]
            parts.append(
                kda_mixer_decode(
                    *rows, conv_pool, state_pool, md.decode_slots, weights, dims, params
                )
            )
        if nv:
            rows = [t[nd : nd + nv] for t in (qkv, f, b, gate)]
            parts.append(
                kda_mixer_verify(
                    *rows, conv_pool, state_pool, md.verify_slots, weights, dims, params
                )
            )
        if T > nd + nv:
            track, p = md.has_mamba_track_mask, slice(nd + nv, T)
            prefill = kda_mixer_prefill(
                qkv[p], f[p], b[p], gate[p], conv_pool, state_pool, md.prefill_slots,
                md.window_layout, md.chunk_layout, weights, dims,
                window_tokens=md.track_window_indices[md.num_decode_tracks :] if track else None,
            )  # fmt: skip
            parts.append(prefill.out)
            windows, chunk_states = prefill.conv_windows, prefill.chunk_states
        if md.has_mamba_track_mask:
            checkpoint_states(md, conv_pool, state_pool, windows, chunk_states)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.tp.all_reduce(self.o_proj(out))
