"""OLMo-Hybrid (`OlmoHybridForCausalLM`, e.g. allenai/Olmo-Hybrid-7B): gated DeltaNet layers with
pre-norm blocks, and attention layers with post-norm blocks, a SwiGLU MLP in every layer:

    linear_attention:  h = h + linear_attn(input_layernorm(h))
                       h = h + mlp(post_attention_layernorm(h))
    full_attention:    h = h + post_attention_layernorm(self_attn(h))
                       h = h + post_feedforward_layernorm(mlp(h))

Its GDN has separate q/k/v/g/a/b projections and three convs on disk (q_conv1d, k_conv1d,
v_conv1d), beta x 2 with `linear_allow_neg_eigval`, and an output norm whose eps is fixed at
1e-5 (transformers' OlmoHybridGatedDeltaNet; FLA's default). Attention normalises q and k over
the whole projection (plain weights), has no output gate, and rotates whole heads unless the
file's rope theta is an explicit null (NoPE, as the released checkpoints run: `rope_theta`).
Plain RMSNorms (weight applied in float32), no MoE.

Weights as transformers names them; files written by olmo-core's conversion may name the
linear layers' norms `attention_layer_norm` / `feedforward_layer_norm` (transformers renames
them on load, and so does `checkpoint_name`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import AttentionConfig, attention_state
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.gated_deltanet import GatedDeltaNet, GDNConfig
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.norm import RMSNorm
from baton.engine.layers.qk_norm_attention import QKNormAttention
from baton.engine.models.qwen_hybrid import read_gdn, read_layer_types
from baton.engine.parallel import TensorParallel

HF_CONFIG_CLASS_PATH = "transformers.models.olmo_hybrid.configuration_olmo_hybrid.OlmoHybridConfig"
GDN_NORM_EPS = 1e-5  # transformers' OlmoHybridGatedDeltaNet.o_norm, whatever rms_norm_eps says
RENAMED = {  # olmo-core's names -> transformers' (its conversion mapping)
    ".attention_layer_norm.": ".input_layernorm.",
    ".feedforward_layer_norm.": ".post_attention_layernorm.",
}
LayerType = Literal["linear_attention", "full_attention"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OlmoHybridConfig:
    layer_types: tuple[LayerType, ...]
    norm_eps: float
    attention: AttentionConfig
    gdn: GDNConfig
    intermediate_size: int

    def uses(self, kind: LayerType) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def read_config(r: ConfigReader) -> ModelConfig:
    hidden = r.need("hidden_size")
    layer_types = read_layer_types(r)
    if "linear_attention" not in layer_types or "full_attention" not in layer_types:
        # transformers' validate_architecture
        raise r.error("'layer_types' must hold both linear_attention and full_attention layers")
    num_heads = r.opt("num_attention_heads")
    # transformers' __post_init__: these default to other keys, not to constants
    kv_heads = r.opt("num_key_value_heads") or num_heads
    r.require_multiple("num_attention_heads", num_heads, "num_key_value_heads", kv_heads)
    Hk = r.opt("linear_num_key_heads") or num_heads
    key_dim = r.opt("linear_key_head_dim") or int(0.75 * hidden / Hk)
    hf = dict(r.hf)
    hf.update(
        linear_num_key_heads=Hk,
        linear_num_value_heads=r.opt("linear_num_value_heads") or num_heads,
        linear_key_head_dim=key_dim,
        linear_value_head_dim=r.opt("linear_value_head_dim") or 2 * key_dim,
    )
    filled = ConfigReader(hf, r.source, r.defaults, r.rope_defaults)
    # transformers: getattr(config, "head_dim", hidden // heads) (the class has no such key)
    head_dim = r.hf.get("head_dim") or hidden // num_heads
    rotary = None
    if rope_theta(r) is not None:
        # whole heads rotate (OlmoHybridRotaryEmbedding reads no partial factor)
        rotary = filled.rotary(head_dim, partial=False)
    norm_eps = float(r.opt("rms_norm_eps"))
    return ModelConfig(
        architecture="OlmoHybridForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=OlmoHybridConfig(
            layer_types=layer_types,
            norm_eps=norm_eps,
            attention=AttentionConfig(
                num_heads=num_heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                bias=bool(r.opt("attention_bias")),
                scale=head_dim**-0.5,
                rotary=rotary,
                key_multiplier=1.0,
            ),
            gdn=read_gdn(
                filled,
                "separate",
                beta_scale=2.0 if r.opt("linear_allow_neg_eigval") else 1.0,
                norm_eps=GDN_NORM_EPS,
                names=("o_norm", "o_proj"),
            ),
            intermediate_size=r.opt("intermediate_size"),
        ),
    )


def rope_theta(r: ConfigReader) -> float | None:
    """The theta transformers' config ends with: `rope_parameters`' when it names one, else a
    top-level `rope_theta`, else the class default (10000). Only an explicit null means NoPE:
    `"rope_parameters": null` alone is filled with the default and rotates."""
    params = r.hf.get("rope_parameters") or {}
    if "rope_theta" in params:
        return params["rope_theta"]
    if "rope_theta" in r.hf:
        return r.hf["rope_theta"]
    return r.rope_defaults.get("rope_theta")


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """GDN conv window and recurrent state at `linear_attention` layers, K/V at the others."""
    olmo = config.family
    uses: list[LayerState] = []
    for kind in olmo.layer_types:
        if kind == "linear_attention":
            uses.append(GatedDeltaNet.state_spec(olmo.gdn, dtype))
        else:
            uses.append(
                attention_state(olmo.attention.num_kv_heads, olmo.attention.head_dim, dtype)
            )
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    olmo = config.family
    state_spec(config, torch.float32).check_tp(size)
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    parallel.split_evenly(olmo.attention.num_heads, probe, "num_attention_heads")
    parallel.kv_head_part(olmo.attention.num_kv_heads, olmo.attention.num_heads, probe)
    parallel.split_evenly(olmo.intermediate_size, probe, "intermediate_size")


def checkpoint_name(name: str) -> str:
    for old, new in RENAMED.items():
        name = name.replace(old, new)
    return name


class PostNormAttentionLayer(nn.Module):
    """An attention layer's post-norm block (module docstring)."""

    def __init__(self, hidden_size: int, config: OlmoHybridConfig, kv_index: int):
        super().__init__()
        self.self_attn = QKNormAttention(
            hidden_size, config.attention, kv_index,
            qk_norm="whole", norm_eps=config.norm_eps, output_gate=False,
        )  # fmt: skip
        self.post_attention_layernorm = RMSNorm(hidden_size, config.norm_eps)
        self.mlp = GatedMLP(hidden_size, config.intermediate_size, False, "silu")
        self.post_feedforward_layernorm = RMSNorm(hidden_size, config.norm_eps)

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, md, cache))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class OlmoHybridModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        olmo, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        gdn_layers, attention_layers = olmo.uses("linear_attention"), olmo.uses("full_attention")
        layers: list[nn.Module] = []
        for i, kind in enumerate(olmo.layer_types):
            if kind == "full_attention":
                layers.append(PostNormAttentionLayer(hidden, olmo, attention_layers.index(i)))
                continue
            layers.append(
                MixerFFNLayer(
                    names=("input_layernorm", "linear_attn", "post_attention_layernorm"),
                    hidden_size=hidden,
                    eps=olmo.norm_eps,
                    mixer=GatedDeltaNet(hidden, olmo.gdn, gdn_layers.index(i)),
                    ffn={"mlp": GatedMLP(hidden, olmo.intermediate_size, False, "silu")},
                    residual_multiplier=1.0,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, olmo.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, OlmoHybridModel(config), "embed_tokens")
