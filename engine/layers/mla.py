"""Multi-head latent attention (MLA) as an engine layer: its paged state (one latent row per
token, not per-head K/V), its weights as DeepSeek-style checkpoints name them, TP sharding, and
the forward over the pages (kernels/mla.py: the absorbed form).

    q        = q_proj(x)                        or q_b_proj(q_a_layernorm(q_a_proj(x)))
               (T, heads, qk_nope + qk_rope)
    c | k_r  = kv_a_proj_with_mqa(x)            (T, kv_lora_rank + qk_rope)
    latent   = [kv_a_layernorm(c) | k_r]        -> the pages: kv_lora_rank + qk_rope values a
                                                   token, whatever the head count
    o        = o_proj(attention of q over the latents through kv_b_proj's W_UK / W_UV)

Kimi Linear's MLA is NoPE (transformers' KimiLinearAttention applies no rotary: the "rope" part of
the key is a shared, unrotated key); Bailing hybrid's rotates q_rope and k_rope with DeepSeek's
interleaved rotary (pairs (x0, x1), (x2, x3)... each by one frequency, written out as
[evens | odds]) before k_rope is stored, and gates each head's output by sigmoid(g_proj(x))
(`head_gate`). Under tensor parallelism a rank holds num_heads / size query
heads (q_proj / q_b_proj and kv_b_proj rows, o_proj columns); the latent, kv_a_proj_with_mqa and
the norms are replicated: every rank keeps every token's whole latent (the state spec says
`split=None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, StateTensor
from baton.engine.config import RotaryConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.norm import RMSNorm
from baton.kernels.attention import rotary_cos_sin
from baton.kernels.mla import mla_attention, rotary_interleaved, store_latent

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not
# rms_norm_eps (DeepseekV3Attention and KimiLinearAttention alike)
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (Kimi Linear)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
    rotary: RotaryConfig | None  # None: NoPE (Kimi Linear); else interleaved over qk_rope
    head_gate: bool  # Bailing: o_h *= sigmoid(g_proj(x))_h before o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_state(config: MLAConfig, dtype: torch.dtype) -> LayerState:
    """One latent row per token in the pages (model dtype): [c_kv | k_rope], replicated on every
    rank (the latent has no heads to split). Per-head K/V of the same layer would take
    num_heads * (qk_head_dim + v_head_dim) values a token."""
    return LayerState(
        kind="mla",
        tensors=(
            StateTensor(
                name="latent",
                kind="paged",
                shape=(config.latent_dim,),
                dtype=dtype,
                split=None,
                checkpointed=True,
            ),
        ),
        chunk_size=None,
        window_width=None,
        page_window=None,
    )


class Weight(nn.Module):
    """A module holding one `weight` that is read, not called as a linear (kv_b_proj: the
    attention reads its W_UK and W_UV halves), so the CPU backend leaves it unpacked; a
    checkpoint storing it quantized is dequantized at load (engine/quantization)."""

    read_not_called = True

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols))


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, hidden_size: int, config: MLAConfig, index: int):
        """index: this layer's pool index among the model's MLA layers."""
        super().__init__()
        self.tp = tp = parallel.current()
        self.config, self.index = config, index
        first, heads = parallel.split_evenly(config.num_heads, tp, "num_attention_heads")
        self.num_heads = heads
        qk, lora = config.qk_head_dim, config.kv_lora_rank
        self.scale = qk**-0.5
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, heads * qk, bias=False)
            q_out = self.q_proj
        else:
            self.q_a_proj = nn.Linear(hidden_size, config.q_lora_rank, bias=config.bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
            q_out = self.q_b_proj
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, config.latent_dim, bias=config.bias)
        self.kv_a_layernorm = RMSNorm(lora, LATENT_NORM_EPS)
        self.kv_b_proj = Weight(heads * (config.qk_nope_head_dim + config.v_head_dim), lora)
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden_size, bias=config.bias)
        self.g_proj = nn.Linear(hidden_size, heads, bias=False) if config.head_gate else None
        self.inv_freq: torch.Tensor | None = None
        if config.rotary is not None:
            # transformers' default rope over qk_rope_head_dim, in float32 (a plain attribute:
            # not in checkpoints, not cast with the model)
            dim = config.rotary.dim
            exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            self.inv_freq = 1.0 / (config.rotary.theta**exponent)
        if tp.size > 1:
            per_head = config.qk_nope_head_dim + config.v_head_dim
            rows = parallel.Slices
            parallel.shard(q_out.weight, rows(dim=0, ranges=((first * qk, heads * qk),)))
            parallel.shard(
                self.kv_b_proj.weight, rows(dim=0, ranges=((first * per_head, heads * per_head),))
            )
            v = config.v_head_dim
            parallel.shard(self.o_proj.weight, rows(dim=1, ranges=((first * v, heads * v),)))
            parallel.shard(self.o_proj.bias, parallel.FirstRankOnly(rank=tp.rank))
            if self.g_proj is not None:
                parallel.shard(self.g_proj.weight, rows(dim=0, ranges=((first, heads),)))

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        c = self.config
        fm = md.forward
        T = x.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, c.qk_head_dim)
        kv, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        if self.inv_freq is not None:
            cos, sin = rotary_cos_sin(fm.batch.positions, self.inv_freq)
            nope = c.qk_nope_head_dim
            q = torch.cat([q[..., :nope], rotary_interleaved(q[..., nope:], cos, sin)], dim=-1)
            k_rope = rotary_interleaved(k_rope[:, None], cos, sin)[:, 0]
        latent_cache = cache.layer("mla", self.index)["latent"]
        store_latent(
            latent_cache, torch.cat([self.kv_a_layernorm(kv), k_rope], -1), fm.slot_mapping
        )
        nd, nv = fm.batch.num_decode_tokens, fm.batch.num_verify_tokens
        segments = (
            (slice(0, nd), fm.decode_attention),
            (slice(nd, nd + nv), fm.verify_attention),
            (slice(nd + nv, T), fm.prefill_attention),
        )
        parts = [
            mla_attention(
                q[rows],
                latent_cache,
                self.kv_b_proj.weight,
                layout,
                nope=c.qk_nope_head_dim,
                v_head_dim=c.v_head_dim,
                scale=self.scale,
            )  # fmt: skip
            for rows, layout in segments
            if layout.num_seqs
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (T, heads, v_head_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x).float()).to(x.dtype)[..., None]
        return self.tp.all_reduce(self.o_proj(out.reshape(T, -1)))
