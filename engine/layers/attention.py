"""Attention over the paged KV cache: GQA, optional bias, with or without rotary embeddings
(full or partial), any softmax scale (Granite's `attention_multiplier`), optional per-head RMS
norms of queries and keys before the rotary (LFM2's q/k layernorms: `q_norm`, `k_norm`).

Rotary embeddings are applied at the cache write (baton.kernels.attention.rotary_store_kv), so the
cache holds rotated keys and decode and extend read the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, Segment, StateTensor, TPSplit
from baton.engine.config import RotaryConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.mlp import fuse_for_cpu
from baton.engine.layers.norm import RMSNorm
from baton.kernels.attention import paged_attention, rotary_cos_sin, rotary_store_kv, store_kv
from baton.kernels.window_attention import window_attention


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionConfig:
    """One attention layer, as a family reads its keys."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    scale: float  # softmax scale: head_dim ** -0.5, or a family's multiplier
    rotary: RotaryConfig | None  # None: no positional encoding (NemotronH is NoPE)
    key_multiplier: float  # keys scaled after k_proj, before the rotary (Falcon-H1; else 1.0)


def attention_state(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, sliding_window: int | None = None
) -> LayerState:
    """K and V of every token, in the KV pages (model dtype; rotated keys where the layer has
    rotary). Under TP split by KV heads, each replicated when there are fewer than ranks.

    sliding_window: the layer reads only the last that-many tokens (its own included), a kind
    of its own ("sliding_attention") whose `page_window` says so: its pages behind the window
    are released during decode (beside full attention, from a page table of its own:
    ModelStateSpec.page_tables)."""
    heads = TPSplit(
        dim=0,
        segments=(
            Segment(
                atoms=num_kv_heads, atom_units=1, replicate_below=True, what="num_key_value_heads"
            ),
        ),
    )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"a sliding window must hold at least one token, got {sliding_window}")
    return LayerState(
        kind="attention" if sliding_window is None else "sliding_attention",
        tensors=tuple(
            StateTensor(
                name=name,
                kind="paged",
                shape=(num_kv_heads, head_dim),
                dtype=dtype,
                split=heads,
                checkpointed=True,
            )
            for name in ("k", "v")
        ),
        chunk_size=None,
        window_width=None,
        page_window=sliding_window,
    )


class Attention(nn.Module):
    """q/k/v/o projections named as transformers names them; `kv_index` is this layer's KV
    pool in the StateCache (one per use: a block reused at several depths gets one per use)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        scale: float,
        rotary: RotaryConfig | None,
        kv_index: int,
        key_multiplier: float = 1.0,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
    ):
        """key_multiplier: keys are scaled after k_proj, before the rotary (Falcon-H1).
        qk_norm_eps: RMS-normalise each query and key head (weights `q_norm`, `k_norm` of
        head_dim) with this eps before the rotary (LFM2); None: no such norms.
        sliding_window: each query attends to the last that-many tokens only (its own included,
        transformers' `kv_idx > q_idx - sliding_window`); its K/V live in the
        "sliding_attention" pools (attention_state).
        Under tensor parallelism (parallel.current()) this rank holds its query heads and the
        KV heads they attend with; o_proj is row-parallel, its output all-reduced."""
        super().__init__()
        self.tp = tp = parallel.current()
        first_q, num_heads = parallel.split_evenly(num_heads, tp, "num_attention_heads")
        first_kv, num_kv_heads = parallel.kv_head_part(num_kv_heads, num_heads * tp.size, tp)
        self.kv_index = kv_index
        self.sliding_window = sliding_window
        self.state_kind = "attention" if sliding_window is None else "sliding_attention"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.key_multiplier = key_multiplier
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        # Applied in attend() only when built here: a subclass with norms of its own
        # (engine/layers/qk_norm_attention.py) applies them itself, under the same names.
        self.norms_heads = qk_norm_eps is not None
        if qk_norm_eps is not None:  # per head: replicated on every rank
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        if tp.size > 1:
            q_rows = parallel.Slices(dim=0, ranges=((first_q * head_dim, num_heads * head_dim),))
            kv_rows = parallel.Slices(
                dim=0, ranges=((first_kv * head_dim, num_kv_heads * head_dim),)
            )
            for proj, rows in (
                (self.q_proj, q_rows),
                (self.k_proj, kv_rows),
                (self.v_proj, kv_rows),
            ):
                parallel.shard(proj.weight, rows)
                parallel.shard(proj.bias, rows)
            parallel.shard(self.o_proj.weight, parallel.Slices(dim=1, ranges=q_rows.ranges))
            parallel.shard(self.o_proj.bias, parallel.FirstRankOnly(rank=tp.rank))
        self.qkv_proj: nn.Module | None = None  # CPU: q, k, v in one packed matmul
        self.qkv_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.inv_freq: torch.Tensor | None = None
        if rotary is not None:
            if not 0 < rotary.num_rotated <= head_dim:
                raise ValueError(f"rotary dim {rotary.dim} must rotate 1..{head_dim} channels")
            # transformers' default rope: theta ** -(2i / dim), computed the same way so that
            # both sides rotate by the same float32 angles. A plain attribute, not a buffer:
            # it is not in checkpoints and stays float32 when the model is cast.
            exponent = torch.arange(0, rotary.dim, 2, dtype=torch.int64).float() / rotary.dim
            self.inv_freq = 1.0 / (rotary.theta**exponent)

    @classmethod
    def from_config(cls, hidden_size: int, config: AttentionConfig, kv_index: int) -> Attention:
        return cls(
            hidden_size=hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            bias=config.bias,
            scale=config.scale,
            rotary=config.rotary,
            kv_index=kv_index,
            key_multiplier=config.key_multiplier,
        )

    def pack_for_cpu(self) -> None:
        """One packed matmul for q, k and v (the three plain projections are dropped), unless
        they are stored differently (mixed precision)."""
        self.qkv_proj = fuse_for_cpu([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv_proj is not None:
            del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        return self.tp.all_reduce(self.o_proj(self.attend(q, k, v, md, cache)))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: Mamba2Metadata,
        cache: StateCache,
        kv_index: int | None = None,
    ) -> torch.Tensor:
        """q: (T, heads * head_dim), k, v: (T, kv_heads * head_dim) projected rows. Stores K/V
        (rotated when this layer has rotary) and returns (T, heads * head_dim) before o_proj.
        kv_index: the KV pool of this use when one module serves several depths (Zamba2)."""
        fm = md.forward
        # a windowed layer beside full ones reads its own page table (ModelStateSpec.page_tables)
        table = fm.table(self.sliding_window is not None)
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.norms_heads:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        state = cache.layer(self.state_kind, self.kv_index if kv_index is None else kv_index)
        k_cache, v_cache = state["k"], state["v"]
        if self.inv_freq is not None:
            # A few cos/sin per token per layer: cheaper than threading a shared table through.
            cos, sin = rotary_cos_sin(fm.batch.positions, self.inv_freq)
            q = rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, table.slot_mapping)
        else:
            store_kv(k_cache, v_cache, k, v, table.slot_mapping)
        nd, nv = fm.batch.num_decode_tokens, fm.batch.num_verify_tokens
        parts = []
        # speculative verify rows: k + 1 causal queries each
        for rows, layout in (
            (slice(0, nd), table.decode_attention),
            (slice(nd, nd + nv), table.verify_attention),
            (slice(nd + nv, T), table.prefill_attention),
        ):
            if not layout.num_seqs:
                continue
            if self.sliding_window is None:
                parts.append(paged_attention(q[rows], k_cache, v_cache, layout, self.scale))
            else:
                parts.append(
                    window_attention(
                        q[rows], k_cache, v_cache, layout, self.scale, self.sliding_window
                    )
                )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(T, -1)
