"""LFM2 (`Lfm2ForCausalLM`, Liquid AI): two-step layers (engine/layers/blocks.py), each a gated short
convolution (engine/layers/short_conv.py: its only state is a conv window) or a GQA attention
with rotary embeddings and per-head q/k RMS norms, then a SwiGLU MLP. Layout from `layer_types`
("conv" / "full_attention"), else the legacy `full_attn_idxs`, else every layer attends (as
transformers' Lfm2Config fills it). The final norm is `embedding_norm`.

Config traps, read as transformers reads them: `block_auto_adjust_ff_dim` (on by default)
rewrites `intermediate_size` to int(2/3 of it), then, when `block_ffn_dim_multiplier` is set,
int(x multiplier) rounded up to a multiple of `block_multiple_of`; the legacy `block_ff_dim`
and `tie_embedding` override `intermediate_size` and `tie_word_embeddings`; the conv width is
`conv_L_cache`.

Weights: `model.embed_tokens`, `model.layers.{i}.operator_norm`, `.conv.{in_proj,conv,out_proj}`
or `.self_attn.{q,k,v,out}_proj` + `.self_attn.{q,k}_layernorm`, `.ffn_norm`,
`.feed_forward.{w1,w3,w2}` (gate, up, down), `model.embedding_norm`, `lm_head` (tied by
default). `checkpoint_name` maps them onto the shared layers' names.
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
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig, attention_state
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.moe import MoE, MoEConfig
from baton.engine.layers.norm import RMSNorm
from baton.engine.layers.short_conv import ShortConv, ShortConvConfig
from baton.engine.parallel import TensorParallel

HF_CONFIG_CLASS_PATH = "transformers.models.lfm2.configuration_lfm2.Lfm2Config"

LAYER_NAMES: dict[str, Literal["conv", "attention"]] = {
    "conv": "conv",
    "full_attention": "attention",
}

# on-disk names -> the shared layers' (the MLP's and each expert's w1/w3/w2, LFM2-MoE's expert
# bias on the router, the attention's out_proj and q/k layernorms)
RENAMES = (
    (re.compile(r"\.feed_forward\.((?:experts\.\d+\.)?)w1\."), r".feed_forward.\1gate_proj."),
    (re.compile(r"\.feed_forward\.((?:experts\.\d+\.)?)w3\."), r".feed_forward.\1up_proj."),
    (re.compile(r"\.feed_forward\.((?:experts\.\d+\.)?)w2\."), r".feed_forward.\1down_proj."),
    (re.compile(r"\.feed_forward\.expert_bias$"), ".feed_forward.gate.e_score_correction_bias"),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.self_attn\.q_layernorm\."), ".self_attn.q_norm."),
    (re.compile(r"\.self_attn\.k_layernorm\."), ".self_attn.k_norm."),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Lfm2Config:
    mixers: tuple[Literal["conv", "attention"], ...]  # one per layer
    norm_eps: float
    attention: AttentionConfig
    conv: ShortConvConfig
    intermediate_size: int  # of the dense MLP (LFM2: after block_auto_adjust_ff_dim)
    moe: MoEConfig | None  # LFM2-MoE: the experts of every layer from num_dense_layers on
    num_dense_layers: int  # the first layers run the dense MLP (LFM2: all of them)


def checkpoint_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name


def mlp_width(r: ConfigReader) -> int:
    """transformers' Lfm2MLP: the width its w1/w2/w3 really have."""
    width = r.hf.get("block_ff_dim", r.opt("intermediate_size"))
    if r.opt("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        multiplier = r.opt("block_ffn_dim_multiplier")
        if multiplier is not None:
            multiple = r.opt("block_multiple_of")
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


def read_layers(r: ConfigReader, num_layers: int, legacy_indices: bool) -> tuple:
    """The per-layer mixer kinds: `layer_types`, else (LFM2 only) `full_attn_idxs`, else every
    layer attends."""
    names = r.hf.get("layer_types")
    if names is None:
        if not legacy_indices:
            raise r.error("missing required key 'layer_types'")
        indices = r.hf.get("full_attn_idxs")
        indices = range(num_layers) if indices is None else indices
        names = ["full_attention" if i in indices else "conv" for i in range(num_layers)]
    if len(names) != num_layers:
        raise r.error(f"'layer_types' lists {len(names)} layers, num_hidden_layers={num_layers}")
    unknown = sorted({n for n in names if n not in LAYER_NAMES})
    if unknown:
        raise r.error(f"'layer_types' has unknown layer types {unknown}")
    return tuple(LAYER_NAMES[n] for n in names)


def read_common(r: ConfigReader, architecture: str, legacy: bool, **family) -> ModelConfig:
    """What LFM2 and LFM2-MoE read alike; `family`: the rest of their Lfm2Config fields."""
    hidden, num_layers = r.need("hidden_size"), r.need("num_hidden_layers")
    heads, kv_heads = r.opt("num_attention_heads"), r.opt("num_key_value_heads")
    r.require_multiple("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    head_dim = r.hf.get("head_dim") or hidden // heads  # transformers: getattr, else this
    eps = float(r.opt("norm_eps"))
    tie = r.hf["tie_embedding"] if legacy and "tie_embedding" in r.hf else None
    return ModelConfig(
        architecture=architecture,
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings") if tie is None else tie),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=Lfm2Config(
            mixers=read_layers(r, num_layers, legacy_indices=legacy),
            norm_eps=eps,
            attention=AttentionConfig(
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                bias=False,
                scale=head_dim**-0.5,
                rotary=r.rotary(head_dim),
                key_multiplier=1.0,
            ),
            conv=ShortConvConfig(
                channels=hidden, conv_kernel=r.opt("conv_L_cache"), bias=bool(r.opt("conv_bias"))
            ),
            **family,
        ),
    )


def read_config(r: ConfigReader) -> ModelConfig:
    # LFM2's own legacy keys: transformers pops `tie_embedding` and `block_ff_dim`
    return read_common(
        r,
        "Lfm2ForCausalLM",
        legacy=True,
        intermediate_size=mlp_width(r),
        moe=None,
        num_dense_layers=r.need("num_hidden_layers"),
    )


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """A conv window at conv layers, K/V at attention layers."""
    lfm = config.family
    uses: list[LayerState] = []
    for kind in lfm.mixers:
        if kind == "attention":
            uses.append(attention_state(lfm.attention.num_kv_heads, lfm.attention.head_dim, dtype))
        else:
            uses.append(ShortConv.state_spec(lfm.conv, dtype))
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks."""
    lfm = config.family
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    if "conv" in lfm.mixers:
        parallel.split_evenly(lfm.conv.channels, probe, "hidden_size")
    if "attention" in lfm.mixers:
        parallel.split_evenly(lfm.attention.num_heads, probe, "num_attention_heads")
        parallel.kv_head_part(lfm.attention.num_kv_heads, lfm.attention.num_heads, probe)
    if lfm.num_dense_layers:
        parallel.split_evenly(lfm.intermediate_size, probe, "intermediate_size")
    if lfm.moe is not None:
        parallel.split_evenly(lfm.moe.intermediate_size, probe, "moe_intermediate_size")


class Lfm2Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        lfm, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        layers = []
        for i, kind in enumerate(lfm.mixers):
            index = lfm.mixers[:i].count(kind)  # the layer's pool among its kind
            if kind == "conv":
                name, mixer = "conv", ShortConv(lfm.conv, index)
            else:
                name, mixer = "self_attn", lfm2_attention(hidden, lfm, index)
            layers.append(
                MixerFFNLayer(
                    names=("operator_norm", name, "ffn_norm"),
                    hidden_size=hidden,
                    eps=lfm.norm_eps,
                    mixer=mixer,
                    ffn={"feed_forward": feed_forward(hidden, lfm, i)},
                    residual_multiplier=1.0,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(hidden, lfm.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.embedding_norm(hidden)


def feed_forward(hidden_size: int, lfm: Lfm2Config, layer: int) -> nn.Module:
    if lfm.moe is not None and layer >= lfm.num_dense_layers:
        return MoE(hidden_size, lfm.moe)
    return GatedMLP(hidden_size, lfm.intermediate_size, False, "silu")


def lfm2_attention(hidden_size: int, lfm: Lfm2Config, index: int) -> Attention:
    a = lfm.attention
    return Attention(
        hidden_size=hidden_size,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        bias=a.bias,
        scale=a.scale,
        rotary=a.rotary,
        kv_index=index,
        qk_norm_eps=lfm.norm_eps,
    )


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, Lfm2Model(config), "embed_tokens")
