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

import torch
from torch import nn

from engine.cache.pools import StateCache
from engine.config import ConfigReader, ModelConfig
from engine.executor.forward_metadata import Mamba2Metadata
from engine.layers.attention import Attention
from engine.layers.causal_lm import CausalLM
from engine.layers.mamba2 import Mamba2Mixer
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.models.bamba import read_attention_keys, read_ssm_keys

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
    return ModelConfig(
        architecture="FalconH1ForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        layer_types=("parallel",) * num_layers,
        norm_eps=float(r.opt("rms_norm_eps")),
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        **attention,
        attention_scale=attention["head_dim"] ** -0.5,
        # transformers' Falcon-H1 rotates whole heads, ignoring any partial_rotary_factor
        rotary=r.rotary(attention["head_dim"], partial=False),
        intermediate_size=r.need("intermediate_size"),
        mlp_bias=bool(r.opt("mlp_bias")),
        mlp_hidden_act="silu",
        embedding_multiplier=float(r.opt("embedding_multiplier")),
        residual_multiplier=1.0,
        logits_scaling=1.0,
        lm_head_multiplier=float(r.opt("lm_head_multiplier")),
        attention_in_multiplier=float(r.opt("attention_in_multiplier")),
        attention_out_multiplier=float(r.opt("attention_out_multiplier")),
        key_multiplier=float(r.opt("key_multiplier")),
        ssm_in_multiplier=float(r.opt("ssm_in_multiplier")),
        ssm_out_multiplier=float(r.opt("ssm_out_multiplier")),
        ssm_multipliers=floats(r, "ssm_multipliers", 5, (1.0,) * 5),
        mlp_multipliers=floats(r, "mlp_multipliers", 2, (1.0, 1.0)),
        mamba_num_heads=n_heads,
        mamba_head_dim=head_dim,
        # transformers' Falcon-H1: in_proj's bias is `mamba_proj_bias`, out_proj's
        # `projectors_bias`
        **read_ssm_keys(r, out_proj_bias_key="projectors_bias"),
        mamba_norm=norm,
        mamba_ssm_cache_dtype="float32",
        moe=None,
        shared_blocks=None,
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
    )


class ParallelLayer(nn.Module):
    """Attention and Mamba side by side, then the MLP (the layer map in the module docstring)."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mamba = Mamba2Mixer(c, c.mamba_layer_ids.index(layer_id))
        self.self_attn = Attention(
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            bias=c.attention_bias,
            scale=c.attention_scale,
            rotary=c.rotary,
            kv_index=c.attention_layer_ids.index(layer_id),
            key_multiplier=c.key_multiplier,
        )
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.feed_forward = GatedMLP(
            c.hidden_size, c.intermediate_size, c.mlp_bias, "silu", c.mlp_multipliers
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
        self.embedding_multiplier = config.embedding_multiplier
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ParallelLayer(config, i) for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.final_layernorm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, FalconH1Model(config), "embed_tokens")
