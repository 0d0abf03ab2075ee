"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`, IBM): Bamba's two-step layers with µP
multipliers and a Mixtral-style MoE beside an always-on shared SwiGLU MLP.

    h = embed(ids) * embedding_multiplier
    h = h + residual_multiplier * mixer(input_layernorm(h))           Mamba2 or attention
    h = h + residual_multiplier * (moe(x) + shared_mlp(x)),  x = post_attention_layernorm(h)
    logits = lm_head(norm(h)) / logits_scaling

Attention: softmax scale `attention_multiplier` (not head_dim ** -0.5); rotary only when
`position_embedding_type` is "rope" (NoPE when it is "nope" or absent), over whole heads (transformers' Granite ignores
a partial_rotary_factor in the file). `num_local_experts` 0: the shared MLP alone.
Weights: `model.embed_tokens`, `model.layers.{i}.{input_layernorm, mamba | self_attn,
post_attention_layernorm, block_sparse_moe.{router.layer, input_linear, output_linear},
shared_mlp.{input_linear, output_linear}}`, `model.norm`, `lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import AttentionConfig
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.mlp import FusedGatedMLP
from baton.engine.layers.moe import MoEConfig, SoftmaxTopKMoE
from baton.engine.layers.norm import RMSNorm
from baton.engine.models.bamba import mixer_for, read_attention_keys, read_mamba_keys
from baton.engine.models.hybrid import HybridConfig, LayerType, hybrid_state_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class GraniteConfig:
    """Granite-4.0-H's own fields: its layers, and the µP multipliers (module docstring)."""

    hybrid: HybridConfig
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float


def state_spec(config: ModelConfig, dtype: torch.dtype):
    """Mamba2 state at `mamba` layers, K/V at attention layers."""
    return hybrid_state_spec(config.family.hybrid, dtype)


HF_CONFIG_CLASS_PATH = (
    "transformers.models.granitemoehybrid.configuration_granitemoehybrid.GraniteMoeHybridConfig"
)
# transformers builds rotary only for "rope" and no positions for anything else; the values a
# published file uses for "no positions" are run as NoPE (every Granite-4.0-H file says "nope"),
# any other name of a scheme (ALiBi...) is refused rather than silently run without positions.
NOPE_VALUES = (None, "nope")
LAYER_NAMES: dict[str, LayerType] = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}


def read_config(r: ConfigReader) -> ModelConfig:
    hidden = r.need("hidden_size")
    num_layers = r.need("num_hidden_layers")
    names = r.opt("layer_types") or ["mamba"] * num_layers  # transformers' default
    unknown = sorted({n for n in names if n not in LAYER_NAMES})
    if unknown:
        raise r.error(f"'layer_types' has unknown layer types {unknown}")
    if len(names) != num_layers:
        raise r.error(f"'layer_types' lists {len(names)} layers, num_hidden_layers={num_layers}")
    r.require("hidden_act", ("silu",))
    position = r.require("position_embedding_type", NOPE_VALUES + ("rope",))
    attention = read_attention_keys(r, hidden)
    num_experts = int(r.opt("num_local_experts"))
    shared = int(r.opt("shared_intermediate_size"))
    moe = None
    if num_experts > 0:
        top_k = int(r.opt("num_experts_per_tok"))
        if not 1 <= top_k <= num_experts:
            raise r.error(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        moe = MoEConfig(
            router="softmax_topk",
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=r.need("intermediate_size"),
            shared_intermediate_size=shared,
            latent_size=None,
            activation="swiglu",
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,  # the softmax over the k chosen logits sums to one
            norm_topk_eps=0.0,
            expert_bias=False,
            routed_scaling_factor=1.0,
            bias=False,
            shared_expert_gate=False,
        )
    hybrid = HybridConfig(
        layer_types=tuple(LAYER_NAMES[n] for n in names),
        norm_eps=float(r.opt("rms_norm_eps")),
        attention=AttentionConfig(
            **attention,
            scale=float(r.opt("attention_multiplier")),
            # transformers' Granite rotates whole heads, ignoring any partial_rotary_factor
            rotary=r.rotary(attention["head_dim"], partial=False) if position == "rope" else None,
            key_multiplier=1.0,
        ),
        mamba=read_mamba_keys(r, hidden),
        intermediate_size=shared,  # the dense MLP every layer has is the shared one
        mlp_bias=False,
        mlp_hidden_act="silu",
        moe=moe,
    )
    return ModelConfig(
        architecture="GraniteMoeHybridForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=GraniteConfig(
            hybrid=hybrid,
            embedding_multiplier=float(r.opt("embedding_multiplier")),
            residual_multiplier=float(r.opt("residual_multiplier")),
            logits_scaling=float(r.opt("logits_scaling")),
        ),
    )


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        granite, hidden = config.family, config.hidden_size
        hybrid = granite.hybrid
        self.embedding_multiplier = granite.embedding_multiplier
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        layers = []
        for i in range(hybrid.num_layers):
            name, mixer = mixer_for(hidden, hybrid, i)
            ffn: dict[str, nn.Module] = {}
            if hybrid.moe is not None:
                ffn["block_sparse_moe"] = SoftmaxTopKMoE(hidden, hybrid.moe)
            ffn["shared_mlp"] = FusedGatedMLP(
                hidden,
                hybrid.intermediate_size,
                False,
                "silu",
                names=("input_linear", "output_linear"),
            )
            layers.append(
                MixerFFNLayer(
                    names=("input_layernorm", name, "post_attention_layernorm"),
                    hidden_size=hidden,
                    eps=hybrid.norm_eps,
                    mixer=mixer,
                    ffn=ffn,
                    residual_multiplier=granite.residual_multiplier,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, hybrid.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            GraniteMoeHybridModel(config),
            "embed_tokens",
            logits_scaling=config.family.logits_scaling,
        )
