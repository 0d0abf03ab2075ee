"""Jamba (`JambaForCausalLM`, AI21): two-step layers (engine/layers/blocks.py), each a Mamba1 mixer
with RMS-normed dt/B/C (engine/layers/mamba1.py) or a GQA attention without positional encoding,
then a SwiGLU MLP or a mixture of experts (Jamba's router: the top-k of a softmax over every
expert, not renormalised; no shared expert). Attention where i % attn_layer_period ==
attn_layer_offset, experts where i % expert_layer_period == expert_layer_offset (when
num_experts > 1), as transformers' JambaConfig lays them out.

Weights (transformers' save_pretrained and AI21's releases): `model.embed_tokens`,
`model.layers.{i}.input_layernorm`, `.mamba.*` or `.self_attn.*`, `.pre_ff_layernorm`,
`.feed_forward.{gate,up,down}_proj` or `.feed_forward.router.weight` +
`.feed_forward.experts.{e}.{gate,up,down}_proj.weight`, `model.final_layernorm`, `lm_head`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig, attention_state
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.mamba1 import MAMBA1_CHUNK_SIZE, Mamba1Config, Mamba1Mixer
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.moe import MoE, MoEConfig
from baton.engine.layers.norm import RMSNorm
from baton.engine.parallel import TensorParallel

HF_CONFIG_CLASS_PATH = "transformers.models.jamba.configuration_jamba.JambaConfig"


@dataclass(frozen=True, kw_only=True, slots=True)
class JambaConfig:
    mixers: tuple[Literal["mamba", "attention"], ...]  # one per layer
    moe_layers: tuple[bool, ...]  # one per layer: the FFN is the MoE (else the dense MLP)
    norm_eps: float
    attention: AttentionConfig
    mamba: Mamba1Config
    intermediate_size: int  # of the dense MLP and of each expert
    moe: MoEConfig | None  # None: no layer has experts


def checkpoint_name(name: str) -> str:
    """The MoE's router is `gate` in memory (the shared MoE layer's name)."""
    return name.replace(".feed_forward.router.", ".feed_forward.gate.")


def read_config(r: ConfigReader) -> ModelConfig:
    hidden, num_layers = r.need("hidden_size"), r.need("num_hidden_layers")
    r.require("hidden_act", ("silu",))
    for kind in ("attn", "expert"):
        period, offset = r.opt(f"{kind}_layer_period"), r.opt(f"{kind}_layer_offset")
        if not 0 <= offset < period:  # transformers' validate_architecture
            raise r.error(
                f"{kind}_layer_offset={offset} must be in 0..{kind}_layer_period-1={period - 1}"
            )
    attn_period, attn_offset = r.opt("attn_layer_period"), r.opt("attn_layer_offset")
    mixers = tuple(
        "attention" if i % attn_period == attn_offset else "mamba" for i in range(num_layers)
    )
    num_experts = int(r.opt("num_experts"))
    expert_period, expert_offset = r.opt("expert_layer_period"), r.opt("expert_layer_offset")
    moe_layers = tuple(
        num_experts > 1 and i % expert_period == expert_offset for i in range(num_layers)
    )
    intermediate = r.need("intermediate_size")
    moe = None
    if any(moe_layers):
        top_k = int(r.opt("num_experts_per_tok"))
        if not 1 <= top_k <= num_experts:
            raise r.error(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        moe = MoEConfig(
            router="topk_of_softmax",
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=intermediate,
            shared_intermediate_size=None,
            latent_size=None,
            activation="swiglu",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            norm_topk_eps=0.0,
            expert_bias=False,
            routed_scaling_factor=1.0,
            bias=False,
            shared_expert_gate=False,
        )
    num_heads, kv_heads = r.opt("num_attention_heads"), r.opt("num_key_value_heads")
    kv_heads = num_heads if kv_heads is None else kv_heads  # transformers' __post_init__
    r.require_multiple("num_attention_heads", num_heads, "num_key_value_heads", kv_heads)
    head_dim = r.hf.get("head_dim") or hidden // num_heads  # transformers: getattr, else this
    rank = r.opt("mamba_dt_rank")
    eps = float(r.opt("rms_norm_eps"))
    return ModelConfig(
        architecture="JambaForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=JambaConfig(
            mixers=mixers,
            moe_layers=moe_layers,
            norm_eps=eps,
            attention=AttentionConfig(
                num_heads=num_heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                bias=False,  # transformers' Jamba attention has none
                scale=head_dim**-0.5,
                rotary=None,  # Jamba's attention has no positional encoding
                key_multiplier=1.0,
            ),
            mamba=Mamba1Config(
                intermediate=r.opt("mamba_expand") * hidden,
                state_size=r.opt("mamba_d_state"),
                conv_kernel=r.opt("mamba_d_conv"),
                dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
                conv_bias=bool(r.opt("mamba_conv_bias")),
                proj_bias=bool(r.opt("mamba_proj_bias")),
                bcdt_norm="weighted",
                norm_eps=eps,
                chunk_size=MAMBA1_CHUNK_SIZE,
                cache_dtype="float32",
                what="intermediate_size (mamba_expand x hidden_size)",
            ),
            intermediate_size=intermediate,
            moe=moe,
        ),
    )


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """Mamba1 state at Mamba layers, K/V at attention layers."""
    jamba = config.family
    uses: list[LayerState] = []
    for kind in jamba.mixers:
        if kind == "attention":
            uses.append(
                attention_state(jamba.attention.num_kv_heads, jamba.attention.head_dim, dtype)
            )
        else:
            uses.append(Mamba1Mixer.state_spec(jamba.mamba, dtype))
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks."""
    jamba = config.family
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    if "mamba" in jamba.mixers:
        parallel.split_evenly(jamba.mamba.intermediate, probe, jamba.mamba.what)
    if "attention" in jamba.mixers:
        parallel.split_evenly(jamba.attention.num_heads, probe, "num_attention_heads")
        parallel.kv_head_part(jamba.attention.num_kv_heads, jamba.attention.num_heads, probe)
    parallel.split_evenly(jamba.intermediate_size, probe, "intermediate_size")


class JambaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        jamba, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        layers = []
        for i, kind in enumerate(jamba.mixers):
            index = jamba.mixers[:i].count(kind)  # the layer's pool among its kind
            if kind == "mamba":
                name, mixer = "mamba", Mamba1Mixer(hidden, jamba.mamba, index)
            else:
                name, mixer = "self_attn", Attention.from_config(hidden, jamba.attention, index)
            ffn = (
                MoE(hidden, jamba.moe)
                if jamba.moe_layers[i]
                else GatedMLP(hidden, jamba.intermediate_size, False, "silu")
            )
            layers.append(
                MixerFFNLayer(
                    names=("input_layernorm", name, "pre_ff_layernorm"),
                    hidden_size=hidden,
                    eps=jamba.norm_eps,
                    mixer=mixer,
                    ffn={"feed_forward": ffn},
                    residual_multiplier=1.0,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(hidden, jamba.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.final_layernorm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, JambaModel(config), "embed_tokens")
