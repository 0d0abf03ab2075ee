"""The gated DeltaNet mixer (Qwen3-Next, Qwen3.5, OLMo-Hybrid) as an engine layer: its state spec,
its weights as each family stores them, TP sharding, and the forward over the pools. The math is
kernels/gdn_mixer.py's (conv over q|k|v + SiLU, gating, the gated delta rule, norm before gate).

Projections as the checkpoints store them (`GDNConfig.projections`), all read into one order

    [ q (Hk dk) | k (Hk dk) | v (Hv dv) ] [ z (Hv dv) ] [ b (Hv) ] [ a (Hv) ]
      -------- conv input qkv ---------     the gate     write      decay

    "qkvz_ba"   Qwen3-Next: in_proj_qkvz, in_proj_ba packed per key head, each group
                [q_h | k_h | v (R dv) | z (R dv)] and [b (R) | a (R)] (R = Hv / Hk); the rows
                are reordered into the blocked order above as they are read (a Slices rule,
                even at TP=1), so qkv, z, b, a are plain column views
    "qkv_z_b_a" Qwen3.5: in_proj_qkv (blocked), in_proj_z, in_proj_b, in_proj_a
    "separate"  OLMo-Hybrid: q/k/v/g/b/a_proj and three convs (q_conv1d, k_conv1d, v_conv1d),
                which are the one depthwise conv over q|k|v cut in three

On the CPU (`pack_for_cpu`) the projections become one prepacked matmul in that order, which is
also the row layout the fused C decode step reads (a and b share a row stride); a quantized
checkpoint that stores them differently (Qwen3.5 FP8: in_proj_qkv and in_proj_z in FP8, in_proj_b
and in_proj_a in bf16) gets one matmul per run of neighbours stored alike ([qkv | z], [b | a]).

Under tensor parallelism a rank holds its value heads (Hv / size) and the key heads they read:
q and k are split by key heads, each replicated on size / Hk ranks when there are fewer key heads
than ranks (vLLM and SGLang split the same way); the conv channels and the state follow
(`state_spec`), out_proj is row-parallel. The layer's slices come from its own state spec, so the
weights and the state cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.mlp import fuse_for_cpu, stored_as
from baton.engine.layers.track import checkpoint_states
from baton.kernels.cpu.gated_delta import GDNDecodeParams
from baton.kernels.gdn_mixer import (
    GDNMixerDims,
    GDNMixerWeights,
    gdn_mixer_decode,
    gdn_mixer_prefill,
    gdn_mixer_verify,
)

# The chunk of the gated delta rule's prefill (no config key: FLA's and transformers' 64). Prefix
# checkpoints sit on multiples of it, so a family's track interval must be one.
GDN_CHUNK_SIZE = 64

GDNProjections = Literal["qkvz_ba", "qkv_z_b_a", "separate"]
PROJECTION_NAMES: dict[GDNProjections, tuple[str, ...]] = {
    "qkvz_ba": ("in_proj_qkvz", "in_proj_ba"),
    "qkv_z_b_a": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "separate": ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"),
}
CONV_NAMES: dict[GDNProjections, tuple[str, ...]] = {
    "qkvz_ba": ("conv1d",),
    "qkv_z_b_a": ("conv1d",),
    "separate": ("q_conv1d", "k_conv1d", "v_conv1d"),
}
Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class GDNConfig:
    """One gated DeltaNet mixer, as a family reads its `linear_*` keys."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    beta_scale: float  # 2.0 with OLMo-Hybrid's linear_allow_neg_eigval, else 1.0
    norm_eps: float  # of the output norm (OLMo-Hybrid fixes it at 1e-5)
    projections: GDNProjections
    names: tuple[str, str]  # (output norm, output projection) as the checkpoint names them

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, kw_only=True, slots=True)
class GDNShard:
    """What one rank holds: its key and value heads (whole-model indices)."""

    first_k: int
    num_k: int
    first_v: int
    num_v: int


def gdn_shard(config: GDNConfig, size: int, rank: int) -> GDNShard:
    """From the conv state's split (q | k | v segments): ConfigError naming the key when the
    heads cannot be shared by `size` ranks."""
    conv = GatedDeltaNet.state_spec(config, torch.float32).tensors[0]
    (q0, qn), _, (v0, vn) = conv.split.ranges(size, rank)
    dk, dv = config.k_head_dim, config.v_head_dim
    return GDNShard(
        first_k=q0 // dk, num_k=qn // dk, first_v=(v0 - 2 * config.key_dim) // dv, num_v=vn // dv
    )


class GatedDeltaNet(nn.Module):
    @staticmethod
    def state_spec(config: GDNConfig, dtype: torch.dtype) -> LayerState:
        """The last K-1 inputs of the conv over q | k | v (model dtype) and the recurrent state
        (Hv, dk, dv) in float32 (as transformers keeps it), per slot, both kept at checkpoints.
        Under TP the conv channels split as q and k by key heads (replicated below the rank
        count), v by value heads; the state by value heads."""
        Hk, Hv = config.num_k_heads, config.num_v_heads
        by_k = Segment(
            atoms=Hk,
            atom_units=config.k_head_dim,
            replicate_below=True,
            what="linear_num_key_heads",
        )
        by_v = Segment(
            atoms=Hv,
            atom_units=config.v_head_dim,
            replicate_below=False,
            what="linear_num_value_heads",
        )
        heads = Segment(
            atoms=Hv, atom_units=1, replicate_below=False, what="linear_num_value_heads"
        )
        return LayerState(
            kind="gdn",
            tensors=(
                StateTensor(
                    name="conv",
                    kind="slot",
                    shape=(config.conv_dim, config.conv_kernel - 1),
                    dtype=dtype,
                    split=TPSplit(dim=0, segments=(by_k, by_k, by_v)),
                    checkpointed=True,
                ),
                StateTensor(
                    name="recurrent",
                    kind="slot",
                    shape=(Hv, config.k_head_dim, config.v_head_dim),
                    dtype=torch.float32,
                    split=TPSplit(dim=0, segments=(heads,)),
                    checkpointed=True,
                ),
            ),
            chunk_size=GDN_CHUNK_SIZE,
            window_width=config.conv_kernel,
            page_window=None,
        )

    def __init__(self, hidden_size: int, config: GDNConfig, index: int):
        """index: this layer's pool index among the model's GDN layers."""
        super().__init__()
        self.tp = tp = parallel.current()
        self.config, self.index = config, index
        self.shard = shard = gdn_shard(config, tp.size, tp.rank)
        dk, dv = config.k_head_dim, config.v_head_dim
        self.dims = GDNMixerDims(
            num_k_heads=shard.num_k,
            num_v_heads=shard.num_v,
            k_head_dim=dk,
            v_head_dim=dv,
            beta_scale=config.beta_scale,
            norm_eps=config.norm_eps,
        )
        key, value, heads = shard.num_k * dk, shard.num_v * dv, shard.num_v
        # Qwen3-Next's packed rows are reordered even at TP=1; the others are read whole there.
        read_rows = tp.size > 1 or config.projections == "qkvz_ba"
        for name, rows in zip(PROJECTION_NAMES[config.projections], self._projection_rows()):
            proj = nn.Linear(hidden_size, sum(n for _, n in rows), bias=False)
            self.add_module(name, proj)
            if read_rows:
                parallel.shard(proj.weight, parallel.Slices(dim=0, ranges=rows))
        self.widths = [2 * key + value, value, heads, heads]  # qkv, z, b, a
        conv_channels = self._conv_channels()
        for name, ranges in zip(CONV_NAMES[config.projections], conv_channels):
            width = sum(n for _, n in ranges)
            conv = nn.Conv1d(width, width, config.conv_kernel, groups=width, bias=False)
            self.add_module(name, conv)
            if tp.size > 1:
                parallel.shard(conv.weight, parallel.Slices(dim=0, ranges=ranges))
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        norm_name, out_name = config.names
        self.add_module(norm_name, nn.Module())
        getattr(self, norm_name).weight = nn.Parameter(torch.ones(dv))
        self.add_module(out_name, nn.Linear(value, hidden_size, bias=False))
        if tp.size > 1:
            v_heads = parallel.Slices(dim=0, ranges=((shard.first_v, heads),))
            parallel.shard(self.dt_bias, v_heads)
            parallel.shard(self.A_log, v_heads)
            columns = ((shard.first_v * dv, value),)
            parallel.shard(getattr(self, out_name).weight, parallel.Slices(dim=1, ranges=columns))
        # CPU: the projections in as few matmuls as their storage allows (pack_for_cpu), and
        # the widths of [qkv | z | b | a] each one's output holds
        self.in_proj: nn.ModuleList | None = None
        self.in_proj_widths: list[list[int]] = []
        self.frozen: tuple[GDNMixerWeights, GDNDecodeParams] | None = None  # CPU: freeze()

    def _projection_rows(self) -> list[Ranges]:
        """The checkpoint rows this rank reads of each projection, in PROJECTION_NAMES order."""
        c, s = self.config, self.shard
        dk, dv, R = c.k_head_dim, c.v_head_dim, c.num_v_heads // c.num_k_heads
        q = ((s.first_k * dk, s.num_k * dk),)
        v = ((s.first_v * dv, s.num_v * dv),)
        heads = ((s.first_v, s.num_v),)
        if c.projections == "qkv_z_b_a":
            return [self._conv_channels()[0], v, heads, heads]
        if c.projections == "separate":
            return [q, q, v, v, heads, heads]
        # Qwen3-Next: per key head h a group of G rows [q_h | k_h | v (R dv) | z (R dv)], and of
        # 2R rows [b (R) | a (R)]; value head j sits in group j // R at position j % R. Read in
        # blocked order: every q, every k, every v, every z (b, then a).
        G = 2 * dk + 2 * R * dv
        my_k = range(s.first_k, s.first_k + s.num_k)
        my_v = range(s.first_v, s.first_v + s.num_v)
        qkvz = (
            [(h * G, dk) for h in my_k]
            + [(h * G + dk, dk) for h in my_k]
            + [((j // R) * G + 2 * dk + (j % R) * dv, dv) for j in my_v]
            + [((j // R) * G + 2 * dk + R * dv + (j % R) * dv, dv) for j in my_v]
        )
        ba = [((j // R) * 2 * R + j % R, 1) for j in my_v]
        ba += [((j // R) * 2 * R + R + j % R, 1) for j in my_v]
        return [_merged(qkvz), _merged(ba)]

    def _conv_channels(self) -> list[Ranges]:
        """Checkpoint channels of each conv tensor this rank reads (one conv over q|k|v, or
        OLMo-Hybrid's three)."""
        c, s = self.config, self.shard
        dk, dv = c.k_head_dim, c.v_head_dim
        q = (s.first_k * dk, s.num_k * dk)
        v = (s.first_v * dv, s.num_v * dv)
        if c.projections == "separate":
            return [(q,), (q,), (v,)]
        return [((q[0], q[1]), (c.key_dim + q[0], q[1]), (2 * c.key_dim + v[0], v[1]))]

    def pack_for_cpu(self) -> None:
        """The projections as prepacked matmuls, rows [qkv | z | b | a]: one over all of them,
        or one per run of neighbours stored alike (the plain projections are dropped). Left
        apart (each then packed on its own) when a run would end inside a width (OLMo-Hybrid's
        q, k, v stored differently) or split b from a beside other widths."""
        names = PROJECTION_NAMES[self.config.projections]
        runs = [list(run) for _, run in groupby(names, key=lambda n: stored_as(getattr(self, n)))]
        widths = _split_widths(
            [sum(getattr(self, n).out_features for n in run) for run in runs], self.widths
        )
        if widths is None:
            return
        # the fused C decode step reads b and a with one row stride: one output, or two alone
        run_of = [i for i, group in enumerate(widths) for _ in group]  # of qkv, z, b, a
        b_run, a_run = widths[run_of[2]], widths[run_of[3]]
        if run_of[2] != run_of[3] and (len(b_run) > 1 or len(a_run) > 1):
            return
        fused = [fuse_for_cpu([getattr(self, n) for n in run]) for run in runs]
        if any(module is None for module in fused):
            return
        self.in_proj, self.in_proj_widths = nn.ModuleList(fused), widths
        for name in names:
            delattr(self, name)

    def freeze(self) -> None:
        """Cache the mixer's weights as the kernels read them and the fused decode step's
        float32 copies (CPU, after loading)."""
        self.frozen = None
        weights = self.mixer_weights()
        self.frozen = (weights, weights.decode_params())

    def mixer_weights(self) -> GDNMixerWeights:
        if self.frozen is not None:
            return self.frozen[0]
        convs = [getattr(self, n).weight[:, 0] for n in CONV_NAMES[self.config.projections]]
        return GDNMixerWeights(
            conv_weight=convs[0] if len(convs) == 1 else torch.cat(convs),
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            norm_weight=getattr(self, self.config.names[0]).weight,
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (T, hidden) -> qkv (T, conv channels), z (T, Hv dv), b, a (T, Hv): column views
        of one output where the layout allows (a and b then share a row stride)."""
        if self.in_proj is not None:
            return tuple(
                part
                for proj, widths in zip(self.in_proj, self.in_proj_widths)
                for part in proj(x).split(widths, dim=-1)
            )
        names = PROJECTION_NAMES[self.config.projections]
        outs = [getattr(self, n)(x) for n in names]
        if self.config.projections == "qkvz_ba":
            return (*outs[0].split(self.widths[:2], dim=-1), *outs[1].split(self.widths[2:], -1))
        if self.config.projections == "qkv_z_b_a":
            return tuple(outs)
        return (torch.cat(outs[:3], dim=-1), *outs[3:])

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then verify rows (speculation), then prefill rows (the batch's
        order)."""
        state = cache.layer("gdn", self.index)
        conv_pool, state_pool = state["conv"], state["recurrent"]
        qkv, z, b, a = self.project(hidden)
        T, nd = hidden.shape[0], md.forward.batch.num_decode_tokens
        nv = md.forward.batch.num_verify_tokens
        weights = self.mixer_weights()
        decode_params = self.frozen[1] if self.frozen is not None else None
        parts, windows, chunk_states = [], None, None
        if nd:
            parts.append(
                gdn_mixer_decode(
                    qkv[:nd],
                    z[:nd],
                    a[:nd],
                    b[:nd],
                    conv_pool,
                    state_pool,
                    md.decode_slots,
                    weights,
                    self.dims,
                    decode_params,
                )  # fmt: skip
            )
        if nv:
            rows = [t[nd : nd + nv] for t in (qkv, z, a, b)]
            slots = md.verify_slots
            parts.append(
                gdn_mixer_verify(
                    *rows, conv_pool, state_pool, slots, weights, self.dims, decode_params
                )
            )
        if T > nd + nv:
            track, p = md.has_mamba_track_mask, slice(nd + nv, T)
            prefill = gdn_mixer_prefill(
                qkv[p], z[p], a[p], b[p], conv_pool, state_pool, md.prefill_slots,
                md.window_layout, md.chunk_layout, weights, self.dims,
                want_chunk_states=track,  # only checkpoints read them
                window_tokens=md.track_window_indices[md.num_decode_tracks :] if track else None,
            )  # fmt: skip
            parts.append(prefill.out)
            windows, chunk_states = prefill.conv_windows, prefill.chunk_states
        if md.has_mamba_track_mask:
            checkpoint_states(md, conv_pool, state_pool, windows, chunk_states)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.tp.all_reduce(getattr(self, self.config.names[1])(out))


def _split_widths(outputs: list[int], widths: list[int]) -> list[list[int]] | None:
    """`widths` cut into consecutive groups summing to each of `outputs`, None if an output
    ends inside a width."""
    groups, rest = [], list(widths)
    for total in outputs:
        group: list[int] = []
        while rest and sum(group) < total:
            group.append(rest.pop(0))
        if sum(group) != total:
            return None
        groups.append(group)
    return groups


def _merged(ranges: list[tuple[int, int]]) -> Ranges:
    """Adjacent ranges joined (fewer, larger reads of the checkpoint tensor)."""
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)
