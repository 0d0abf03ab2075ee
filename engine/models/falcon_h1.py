"""Falcon-H1 (`FalconH1ForCausalLM`, TII): every layer runs attention and Mamba2 side by side on
the same normed input (layer kind "parallel": it owns a KV pool and a Mamba state), then a
SwiGLU MLP, with µP multipliers everywhere:

    x = input_layernorm(h)
    h = h + (ssm_out_multiplier * mamba(x) + attention_out_multiplier * attn(attention_in_multiplier * x))
    h = h + feed_forward(pre_ff_layernorm(h))       gate x mlp_multipliers[0], down x [1]
    embeddings x embedding_multiplier; logits x lm_head_multiplier

Mamba: input x ssm_in_multiplier, in_proj segments x ssm_multipliers (transformers'
`mup_vector`, not in checkpoints), intermediate `mamba_d_ssm`, the norm optional
(`mamba_rms_norm`) and before or after the gate (`mamba_norm_before_gate`). Attention: keys x
key_multiplier before the rotary, which covers whole heads (a partial_rotary_factor in the file
is ignored, as transformers ignores it). Weights: `model.embed_tokens`, `model.layers.{i}.{
input_layernorm, mamba.*, self_attn.*, pre_ff_layernorm, feed_forward.*}`,
`model.final_layernorm`, `lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.norm import RMSNorm
from baton.engine.models.bamba import read_attention_keys, read_ssm_keys
from baton.engine.models.hybrid import HybridConfig, hybrid_state_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class FalconH1Config:
    """Falcon-H1's own fields: its layers (the Mamba input and segment multipliers and the
    key multiplier live in their layers' configs), and the µP multipliers of the layer map
    above."""

    hybrid: HybridConfig
    embedding_multiplier: float
    lm_head_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    ssm_out_multiplier: float
    mlp_multipliers: tuple[float, float]


def state_spec(config: ModelConfig, dtype: torch.dtype):
    """Mamba2 state and K/V at every (parallel) layer."""
    return hybrid_state_spec(config.family.hybrid, dtype)


HF_CONFIG_CLASS_PATH = "transformers.models.falcon_h1.configuration_falcon_h1.FalconH1Config"


def floats(r: ConfigReader, key: str, count: int, default: tuple[float, ...]) -> tuple:
    value = r.opt(key)
    if value is None:  # transformers' __post_init__ fills ones
        return default
    if len(value) != count:
        raise r.error(f"{key} must list {count} numbers, got {value!r}")
    return tuple(float(v) for v in value)


def read_config(r: ConfigReader) -> ModelConfig:
    hidden = r.need("hidden_size")
    num_layers = r.need("num_hidden_layers")
    r.require("hidden_act", ("silu",))
    attention = read_attention_keys(r, hidden)
    n_heads = r.opt("mamba_n_heads")
    d_ssm = r.opt("mamba_d_ssm")
    intermediate = r.opt("mamba_expand") * hidden if d_ssm is None else d_ssm
    head_dim = r.opt("mamba_d_head")
    if head_dim == "auto":
        head_dim = intermediate // n_heads
    if head_dim * n_heads != intermediate:
        raise r.error(
            f"mamba_d_head={head_dim} x mamba_n_heads={n_heads} must equal the Mamba width "
            f"{intermediate} (mamba_d_ssm, else mamba_expand x hidden_size)"
        )
    r.require_multiple("mamba_n_heads", n_heads, "mamba_n_groups", r.opt("mamba_n_groups"))
    if not r.opt("mamba_rms_norm"):
        norm = "none"
    else:
        norm = "norm_then_gate" if r.opt("mamba_norm_before_gate") else "gated"
    hybrid = HybridConfig(
        layer_types=("parallel",) * num_layers,
        norm_eps=float(r.opt("rms_norm_eps")),
        attention=AttentionConfig(
            **attention,
            scale=attention["head_dim"] ** -0.5,
            # transformers' Falcon-H1 rotates whole heads, ignoring any partial_rotary_factor
            rotary=r.rotary(attention["head_dim"], partial=False),
            key_multiplier=float(r.opt("key_multiplier")),
        ),
        mamba=Mamba2Config(
            num_heads=n_heads,
            head_dim=head_dim,
            # transformers' Falcon-H1: in_proj's bias is `mamba_proj_bias`, out_proj's
            # `projectors_bias`
            **read_ssm_keys(r, out_proj_bias_key="projectors_bias"),
            norm=norm,
            cache_dtype="float32",
            in_multiplier=float(r.opt("ssm_in_multiplier")),
            multipliers=floats(r, "ssm_multipliers", 5, (1.0,) * 5),
        ),
        intermediate_size=r.need("intermediate_size"),
        mlp_bias=bool(r.opt("mlp_bias")),
        mlp_hidden_act="silu",
        moe=None,
    )
    return ModelConfig(
        architecture="FalconH1ForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=FalconH1Config(
            hybrid=hybrid,
            embedding_multiplier=float(r.opt("embedding_multiplier")),
            lm_head_multiplier=float(r.opt("lm_head_multiplier")),
            attention_in_multiplier=float(r.opt("attention_in_multiplier")),
            attention_out_multiplier=float(r.opt("attention_out_multiplier")),
            ssm_out_multiplier=float(r.opt("ssm_out_multiplier")),
            mlp_multipliers=floats(r, "mlp_multipliers", 2, (1.0, 1.0)),
        ),
    )


class ParallelLayer(nn.Module):
    """Attention and Mamba side by side, then the MLP (the layer map in the module docstring)."""

    def __init__(self, hidden_size: int, config: FalconH1Config, layer_id: int):
        super().__init__()
        c, h = config, config.hybrid
        self.input_layernorm = RMSNorm(hidden_size, h.norm_eps)
        self.mamba = Mamba2Mixer(hidden_size, h.mamba, h.mamba_layer_ids.index(layer_id))
        self.self_attn = Attention.from_config(
            hidden_size, h.attention, h.attention_layer_ids.index(layer_id)
        )
        self.pre_ff_layernorm = RMSNorm(hidden_size, h.norm_eps)
        self.feed_forward = GatedMLP(
            hidden_size, h.intermediate_size, h.mlp_bias, "silu", c.mlp_multipliers
        )
        self.multipliers = (c.ssm_out_multiplier, c.attention_in_multiplier)
        self.attention_out_multiplier = c.attention_out_multiplier

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        ssm_out, attention_in = self.multipliers
        normed = self.input_layernorm(hidden)
        mamba = self.mamba(normed, md, cache) * ssm_out
        attention = self.self_attn(normed * attention_in, md, cache)
        hidden = hidden + (mamba + attention * self.attention_out_multiplier)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class FalconH1Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        falcon, hidden = config.family, config.hidden_size
        self.embedding_multiplier = falcon.embedding_multiplier
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            ParallelLayer(hidden, falcon, i) for i in range(falcon.hybrid.num_layers)
        )
        self.final_layernorm = RMSNorm(hidden, falcon.hybrid.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.final_layernorm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            FalconH1Model(config),
            "embed_tokens",
            lm_head_multiplier=config.family.lm_head_multiplier,
        )
