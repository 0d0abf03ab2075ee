"""Attention with RMS-normalised queries and keys, and optionally a sigmoid output gate: the
attention of the gated DeltaNet hybrids. The paged KV cache, rotary and the attention kernels are
the shared layer's (engine/layers/attention.py); this adds what happens before the cache write
and after the attention.

    "per_head"  Qwen3-Next / Qwen3.5: q_norm, k_norm over each head (head_dim wide) with a
                zero-centred weight (1 + w); q_proj also yields a gate per head, its rows per
                head [q_h (hd) | gate_h (hd)], and the output is attention * sigmoid(gate)
    "whole"     OLMo-Hybrid: q_norm over the whole q projection (heads x hd), k_norm over the
                whole k projection, plain weights; no gate

Under tensor parallelism a whole-projection norm spans the ranks: each rank squares its part
and the sums are all-reduced. With fewer KV heads than ranks a KV head is held by size / kv
ranks, so the all-reduced sum counts it that many times; dividing by size x the local width
gives the mean either way (every rank holds the same width).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig
from baton.engine.layers.norm import RMSNorm, ZeroCenteredRMSNorm

QKNorm = Literal["per_head", "whole"]


class QKNormAttention(Attention):
    def __init__(
        self,
        hidden_size: int,
        config: AttentionConfig,
        kv_index: int,
        *,
        qk_norm: QKNorm,
        norm_eps: float,
        output_gate: bool,
    ):
        super().__init__(
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
        tp, hd = self.tp, config.head_dim
        first_q, _ = parallel.split_evenly(config.num_heads, tp, "num_attention_heads")
        first_kv, _ = parallel.kv_head_part(config.num_kv_heads, config.num_heads, tp)
        self.qk_norm, self.output_gate = qk_norm, output_gate
        if output_gate:
            # q_proj rows per head [q_h | gate_h]: this rank reads its heads' row pairs.
            self.q_proj = nn.Linear(hidden_size, 2 * self.num_heads * hd, bias=config.bias)
            self.qkv_sizes[0] = 2 * self.num_heads * hd
            if tp.size > 1:
                rows = parallel.Slices(dim=0, ranges=((2 * first_q * hd, 2 * self.num_heads * hd),))
                parallel.shard(self.q_proj.weight, rows)
                parallel.shard(self.q_proj.bias, rows)
        if qk_norm == "per_head":
            self.q_norm = ZeroCenteredRMSNorm(hd, norm_eps)
            self.k_norm = ZeroCenteredRMSNorm(hd, norm_eps)
        else:
            self.q_norm = RMSNorm(self.num_heads * hd, norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * hd, norm_eps)
            if tp.size > 1:
                q_part = ((first_q * hd, self.num_heads * hd),)
                kv_part = ((first_kv * hd, self.num_kv_heads * hd),)
                parallel.shard(self.q_norm.weight, parallel.Slices(dim=0, ranges=q_part))
                parallel.shard(self.k_norm.weight, parallel.Slices(dim=0, ranges=kv_part))

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        T, hd = x.shape[0], self.head_dim
        gate = None
        if self.output_gate:
            pairs = q.view(T, self.num_heads, 2 * hd)
            q = pairs[..., :hd].reshape(T, self.num_heads * hd)
            gate = pairs[..., hd:].reshape(T, self.num_heads * hd)
        if self.qk_norm == "per_head":
            q = self.q_norm(q.reshape(T * self.num_heads, hd)).view(T, -1)
            k = self.k_norm(k.reshape(T * self.num_kv_heads, hd)).view(T, -1)
        else:
            q, k = self.norm_across_ranks(q, self.q_norm), self.norm_across_ranks(k, self.k_norm)
        out = self.attend(q, k, v, md, cache)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(out))

    def norm_across_ranks(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x: (T, local width) RMS-normalised over the whole projection (module docstring)."""
        if self.tp.size == 1:
            return norm(x)
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        xf = xf * torch.rsqrt(squares / (self.tp.size * x.shape[-1]) + norm.eps)
        return (norm.weight.float() * xf).to(x.dtype)
