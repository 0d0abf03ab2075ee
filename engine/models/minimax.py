"""MiniMax-Text-01 / M1 (`MiniMaxForCausalLM`): lightning attention (engine/layers/
lightning_attention.py) in most layers, softmax attention (GQA, rotary over whole heads) in the
others, a Mixtral-style MoE after each; the residual stream is taken after each norm and both
parts are scaled (transformers 5.25's MiniMaxDecoderLayer):

    h = input_layernorm(x);          x = alpha_attn * h + beta_attn * mixer(h)
    h = post_attention_layernorm(x); x = alpha_mlp * h + beta_mlp * moe(h)

alpha/beta per part: `linear_attn_alpha_factor` / `linear_attn_beta_factor` after lightning
layers, `full_attn_*` after softmax ones, `mlp_*` after the MoE. The router is a softmax over
every expert in float32, the top `num_experts_per_tok` renormalised to sum one.

Config read as transformers 5.25's MiniMaxConfig reads it: `layer_types` defaults to
alternating full / linear (full at even layers), `head_dim` to hidden / heads, the rope from
`rope_parameters` or a top-level `rope_theta` (default theta 1e6), `sliding_window` (null:
full attention) windows the softmax layers. Keys of the release's remote code that transformers
does not read are refused by name where they would change the model: `rotary_dim` other than
head_dim (transformers rotates whole heads), `postnorm: false`, `shared_intermediate_size` > 0
(transformers has no shared expert), an `attn_type_list` (0 = lightning) that disagrees with
the layer types, and the `layernorm_*_alpha/beta` spellings where they differ from the
`*_factor` keys transformers reads.

Weights: `model.layers.{i}.{input_layernorm, post_attention_layernorm}`, `.self_attn.` (softmax:
`q_proj, k_proj, v_proj, o_proj`; lightning: `qkv_proj, output_gate, norm, out_proj`; its stored
decay buffers are skipped), `.block_sparse_moe.gate`, `.block_sparse_moe.experts.{e}.{w1, w3,
w2}` (gate, up, down), `model.norm`, `lm_head` (untied by default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig, RotaryConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, attention_state
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.lightning_attention import LightningAttention, LightningConfig
from baton.engine.layers.moe import MoE, MoEConfig
from baton.engine.layers.norm import RMSNorm
from baton.engine.parallel import TensorParallel

__all__ = [
    "HF_CONFIG_CLASS_PATH",
    "Model",
    "check_tp",
    "checkpoint_name",
    "read_config",
    "state_spec",
]

HF_CONFIG_CLASS_PATH = "transformers.models.minimax.configuration_minimax.MiniMaxConfig"

LayerType = Literal["full_attention", "linear_attention"]
LAYER_TYPES: tuple[str, ...] = ("full_attention", "linear_attention")
RENAMES = (
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
)
DECAY_BUFFERS = re.compile(r"\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$")
# remote-code spelling -> the key transformers reads
LEGACY_FACTORS = {
    "layernorm_full_attention_alpha": "full_attn_alpha_factor",
    "layernorm_full_attention_beta": "full_attn_beta_factor",
    "layernorm_linear_attention_alpha": "linear_attn_alpha_factor",
    "layernorm_linear_attention_beta": "linear_attn_beta_factor",
    "layernorm_mlp_alpha": "mlp_alpha_factor",
    "layernorm_mlp_beta": "mlp_beta_factor",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniMaxConfig:
    layer_types: tuple[LayerType, ...]
    norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: RotaryConfig
    sliding_window: int | None  # of the softmax layers; None: full attention
    lightning: LightningConfig
    moe: MoEConfig
    # (alpha, beta) of the residual after each part
    full_attn_factors: tuple[float, float]
    linear_attn_factors: tuple[float, float]
    mlp_factors: tuple[float, float]


def checkpoint_name(name: str) -> str | None:
    """Experts' w1/w3/w2 as gate/up/down; lightning layers' stored decay buffers skipped (the
    layer computes them from the config, as transformers' init does)."""
    if DECAY_BUFFERS.search(name):
        return None
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name


def read_layer_types(r: ConfigReader, num_layers: int) -> tuple[LayerType, ...]:
    names = r.hf.get("layer_types")
    if names is None:  # MiniMaxConfig.__post_init__'s pattern
        names = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(num_layers)]
    if len(names) != num_layers:
        raise r.error(f"'layer_types' lists {len(names)} layers, num_hidden_layers={num_layers}")
    unknown = sorted({n for n in names if n not in LAYER_TYPES})
    if unknown:
        raise r.error(
            f"'layer_types' has unknown layer types {unknown} (MiniMax has {LAYER_TYPES})"
        )
    legacy = r.hf.get("attn_type_list")
    if legacy is not None:
        from_legacy = ["linear_attention" if t == 0 else "full_attention" for t in legacy]
        if from_legacy != list(names):
            raise r.error(
                "'attn_type_list' disagrees with the layer types transformers runs "
                "('layer_types' or its alternating default): transformers ignores "
                "'attn_type_list'; write the layers as 'layer_types'"
            )
    return tuple(names)


def read_factors(r: ConfigReader, part: str) -> tuple[float, float]:
    values = []
    for which in ("alpha", "beta"):
        key = f"{part}_{which}_factor"
        value = float(r.opt(key))
        for legacy, read in LEGACY_FACTORS.items():
            if read == key and legacy in r.hf and float(r.hf[legacy]) != value:
                raise r.error(
                    f"'{legacy}'={r.hf[legacy]} but '{key}'={value}: transformers reads only "
                    f"'{key}'"
                )
        values.append(value)
    return values[0], values[1]


def read_config(r: ConfigReader) -> ModelConfig:
    hidden, num_layers = r.need("hidden_size"), r.need("num_hidden_layers")
    heads = r.opt("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads") or heads
    r.require_multiple("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    head_dim = r.opt("head_dim") or hidden // heads
    r.require("hidden_act", ("silu",))
    rotary_dim = r.hf.get("rotary_dim")
    if rotary_dim is not None and rotary_dim != head_dim:
        raise r.error(
            f"rotary_dim={rotary_dim} with head_dim={head_dim}: transformers' MiniMax ignores "
            "'rotary_dim' and rotates whole heads, so it would not run this model as written"
        )
    if r.hf.get("postnorm") is False:
        raise r.error(
            "postnorm=false: transformers' MiniMax takes the residual after each norm "
            "(postnorm true) whatever this key says"
        )
    if r.hf.get("shared_intermediate_size"):
        raise r.error(
            f"shared_intermediate_size={r.hf['shared_intermediate_size']}: transformers' MiniMax "
            "has no shared expert"
        )
    window = r.opt("sliding_window")
    if window is not None and window < 1:
        raise r.error(f"sliding_window={window!r} must be null or >= 1")
    eos = r.opt("eos_token_id")
    return ModelConfig(
        architecture="MiniMaxForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=MiniMaxConfig(
            layer_types=read_layer_types(r, num_layers),
            norm_eps=float(r.opt("rms_norm_eps")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary=r.rotary(head_dim, partial=False),
            sliding_window=window,
            lightning=LightningConfig(num_heads=heads, head_dim=head_dim, num_layers=num_layers),
            moe=MoEConfig(
                router="softmax_topk",
                num_experts=r.opt("num_local_experts"),
                top_k=r.opt("num_experts_per_tok"),
                intermediate_size=r.opt("intermediate_size"),
                shared_intermediate_size=None,
                latent_size=None,
                activation="swiglu",
                n_group=1,
                topk_group=1,
                norm_topk_prob=True,
                norm_topk_eps=0.0,
                expert_bias=False,
                routed_scaling_factor=1.0,
                bias=False,
                shared_expert_gate=False,
            ),
            full_attn_factors=read_factors(r, "full_attn"),
            linear_attn_factors=read_factors(r, "linear_attn"),
            mlp_factors=read_factors(r, "mlp"),
        ),
    )


def layer_state(family: MiniMaxConfig, kind: LayerType, dtype: torch.dtype) -> LayerState:
    if kind == "linear_attention":
        return LightningAttention.state_spec(family.lightning, dtype)
    return attention_state(family.num_kv_heads, family.head_dim, dtype, family.sliding_window)


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """A (heads, dk, dv) state per lightning layer; K/V per softmax layer."""
    family = config.family
    return ModelStateSpec.of([layer_state(family, kind, dtype) for kind in family.layer_types])


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks."""
    family = config.family
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    parallel.split_evenly(family.num_heads, probe, "num_attention_heads")
    if "full_attention" in family.layer_types:
        parallel.kv_head_part(family.num_kv_heads, family.num_heads, probe)
    parallel.split_evenly(family.moe.intermediate_size, probe, "intermediate_size")


class MiniMaxLayer(nn.Module):
    def __init__(self, hidden_size: int, family: MiniMaxConfig, layer: int, index: int):
        """index: the layer's pool index among the layers of its type."""
        super().__init__()
        kind = family.layer_types[layer]
        self.input_layernorm = RMSNorm(hidden_size, family.norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, family.norm_eps)
        if kind == "linear_attention":
            self.self_attn: nn.Module = LightningAttention(
                hidden_size, family.lightning, layer, index
            )
            self.attn_factors = family.linear_attn_factors
        else:
            self.self_attn = Attention(
                hidden_size=hidden_size,
                num_heads=family.num_heads,
                num_kv_heads=family.num_kv_heads,
                head_dim=family.head_dim,
                bias=False,
                scale=family.head_dim**-0.5,
                rotary=family.rotary,
                kv_index=index,
                sliding_window=family.sliding_window,
            )
            self.attn_factors = family.full_attn_factors
        self.mlp_factors = family.mlp_factors
        self.block_sparse_moe = MoE(hidden_size, family.moe)

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        # as transformers: residual * alpha + part * beta, each product rounded in the model dtype
        h = self.input_layernorm(hidden)
        alpha, beta = self.attn_factors
        hidden = h * alpha + self.self_attn(h, md, cache) * beta
        h = self.post_attention_layernorm(hidden)
        alpha, beta = self.mlp_factors
        return h * alpha + self.block_sparse_moe(h) * beta


class MiniMaxModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        family, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            MiniMaxLayer(hidden, family, i, family.layer_types[:i].count(kind))
            for i, kind in enumerate(family.layer_types)
        )
        self.norm = RMSNorm(hidden, family.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, MiniMaxModel(config), "embed_tokens")
