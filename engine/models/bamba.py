"""Bamba (`BambaForCausalLM`, IBM): two-step layers (engine/layers/blocks.py), each a Mamba2
mixer or a rotary attention (partial rotary, GQA) followed by a SwiGLU MLP; attention at
`attn_layer_indices`, Mamba elsewhere.

Weights (transformers' save_pretrained): `model.embed_tokens`, `model.layers.{i}.input_layernorm`,
`.mamba.*` or `.self_attn.*`, `.pre_ff_layernorm`, `.feed_forward.{gate,up,down}_proj`,
`model.final_layernorm`, `lm_head`.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.norm import RMSNorm
from baton.engine.models.hybrid import HybridConfig, hybrid_state_spec

HF_CONFIG_CLASS_PATH = "transformers.models.bamba.configuration_bamba.BambaConfig"


def state_spec(config: ModelConfig, dtype: torch.dtype):
    """Mamba2 state at `mamba` layers, K/V at attention layers."""
    return hybrid_state_spec(config.family, dtype)


def read_ssm_keys(r: ConfigReader, out_proj_bias_key: str = "mamba_proj_bias") -> dict:
    """The SSM and conv `mamba_*` keys every family named after Bamba's config (Bamba,
    Granite-4.0-H, Falcon-H1) reads the same way, as Mamba2Config fields. out_proj_bias_key:
    the key of the Mamba out_proj's bias (Falcon-H1's is `projectors_bias`)."""
    return dict(
        state_size=r.opt("mamba_d_state"),
        n_groups=r.opt("mamba_n_groups"),
        conv_kernel=r.opt("mamba_d_conv"),
        chunk_size=r.opt("mamba_chunk_size"),
        conv_bias=bool(r.opt("mamba_conv_bias")),
        proj_bias=bool(r.opt("mamba_proj_bias")),
        out_proj_bias=bool(r.opt(out_proj_bias_key)),
        norm_eps=float(r.opt("rms_norm_eps")),
        time_step_limit=r.time_step_limit(),
    )


def read_mamba_keys(r: ConfigReader, hidden: int) -> Mamba2Config:
    """The `mamba_*` keys Bamba and Granite-4.0-H share."""
    n_heads = r.opt("mamba_n_heads")
    intermediate = r.opt("mamba_expand") * hidden
    head_dim = r.opt("mamba_d_head")
    if head_dim == "auto":  # transformers' rule
        head_dim = intermediate // n_heads
    if head_dim * n_heads != intermediate:
        raise r.error(
            f"mamba_d_head={head_dim} x mamba_n_heads={n_heads} must equal "
            f"mamba_expand x hidden_size={intermediate}"
        )
    r.require_multiple("mamba_n_heads", n_heads, "mamba_n_groups", r.opt("mamba_n_groups"))
    return Mamba2Config(
        num_heads=n_heads,
        head_dim=head_dim,
        **read_ssm_keys(r),
        norm="gated",
        # transformers keeps no other SSM cache dtype for these families; baton's pool default
        cache_dtype="float32",
        in_multiplier=1.0,
        multipliers=(1.0,) * 5,
    )


def read_attention_keys(r: ConfigReader, hidden: int) -> dict:
    """The head keys of Bamba-named configs, as AttentionConfig fields (the scale, rotary and
    key multiplier are each family's)."""
    num_heads = r.need("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads")
    kv_heads = num_heads if kv_heads is None else kv_heads
    r.require_multiple("num_attention_heads", num_heads, "num_key_value_heads", kv_heads)
    # transformers reads `head_dim` when the file has it (getattr), else hidden / heads
    head_dim = r.hf.get("head_dim") or hidden // num_heads
    return dict(
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        bias=bool(r.opt("attention_bias")),
    )


def read_config(r: ConfigReader) -> ModelConfig:
    hidden = r.need("hidden_size")
    num_layers = r.need("num_hidden_layers")
    attn = r.opt("attn_layer_indices") or []
    if any(not 0 <= i < num_layers for i in attn):
        raise r.error(f"attn_layer_indices {attn} must lie in 0..num_hidden_layers-1")
    r.require("hidden_act", ("silu",))
    heads = read_attention_keys(r, hidden)
    return ModelConfig(
        architecture="BambaForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=HybridConfig(
            layer_types=tuple("attention" if i in attn else "mamba" for i in range(num_layers)),
            norm_eps=float(r.opt("rms_norm_eps")),
            attention=AttentionConfig(
                **heads,
                scale=heads["head_dim"] ** -0.5,
                rotary=r.rotary(heads["head_dim"]),
                key_multiplier=1.0,
            ),
            mamba=read_mamba_keys(r, hidden),
            intermediate_size=r.need("intermediate_size"),
            mlp_bias=bool(r.opt("mlp_bias")),
            mlp_hidden_act="silu",
            moe=None,
        ),
    )


def mixer_for(hidden_size: int, config: HybridConfig, layer_id: int) -> tuple[str, nn.Module]:
    """(name, module) of layer `layer_id`'s mixer as Bamba and Granite-4.0-H name them."""
    if config.layer_types[layer_id] == "mamba":
        return "mamba", Mamba2Mixer(
            hidden_size, config.mamba, config.mamba_layer_ids.index(layer_id)
        )
    return "self_attn", Attention.from_config(
        hidden_size, config.attention, config.attention_layer_ids.index(layer_id)
    )


class BambaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hybrid, hidden = config.family, config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        layers = []
        for i in range(hybrid.num_layers):
            name, mixer = mixer_for(hidden, hybrid, i)
            ffn = GatedMLP(hidden, hybrid.intermediate_size, hybrid.mlp_bias, "silu")
            layers.append(
                MixerFFNLayer(
                    names=("input_layernorm", name, "pre_ff_layernorm"),
                    hidden_size=hidden,
                    eps=hybrid.norm_eps,
                    mixer=mixer,
                    ffn={"feed_forward": ffn},
                    residual_multiplier=1.0,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(hidden, hybrid.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.final_layernorm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, BambaModel(config), "embed_tokens")
