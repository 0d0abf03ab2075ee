"""NemotronH (`NemotronHForCausalLM`): a stack of single-mixer blocks, pre-RMSNorm -> one of
Mamba2 / attention (NoPE, GQA) / relu² MLP / MoE -> residual. Layout from
`hybrid_override_pattern` (`M`, `*`, `-`, `E`) or `layers_block_type`; legacy key aliases.

Weights: `backbone.` on disk, `model.` in memory (`checkpoint_name`); `model.embeddings`,
`model.layers.{i}.norm`, `model.layers.{i}.mixer.*`, `model.norm_f`. transformers' NemotronH
never ties lm_head to the embeddings, so a checkpoint that stores its own lm_head uses it
whatever tie_word_embeddings says. Every layer splits for tensor parallelism (`check_tp`).

Multi-token prediction (Nemotron 3 Super; speculative decoding with method "mtp"):
`num_nextn_predict_layers` (1, as vLLM's nemotron_h_mtp runs) MTP layer of the blocks in
`mtp_layers_block_type` (legacy `mtp_hybrid_override_pattern`; transformers' default
["full_attention", "moe"]), attention and MoE blocks as vLLM accepts. Weights
`mtp.layers.{j}.{norm,mixer.*}` per block, `mtp.layers.0.{enorm,hnorm,eh_proj}` fuse the next
token's embedding with the target's final hidden state, `mtp.layers.{last}.final_layernorm`
ends it; embedding and lm_head are the model's. Built only when the engine drafts with it
(ModelConfig.num_nextn_predict_layers > 0 then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig, attention_state
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from baton.engine.layers.mlp import ReluSquaredMLP
from baton.engine.layers.moe import MoE, MoEConfig
from baton.engine.layers.mtp import mtp_state
from baton.engine.layers.norm import RMSNorm
from baton.engine.models.hybrid import HybridConfig, LayerType, check_hybrid_tp, hybrid_layer_states

UNTIE_WITH_STORED_LM_HEAD = True
# The block kinds an MTP layer may hold (vLLM's nemotron_h_mtp: attention "*" and MoE "E").
MTP_BLOCK_TYPES: tuple[LayerType, ...] = ("attention", "moe")


@dataclass(frozen=True, kw_only=True, slots=True)
class NemotronHConfig(HybridConfig):
    """The hybrid layout plus the MTP layer's block kinds (empty: the checkpoint has none)."""

    mtp_layer_types: tuple[LayerType, ...]


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """Mamba2 state at `mamba` layers, K/V at attention layers; with the MTP layer built, K/V
    at its attention blocks (pool indices after the model's own) and the target's last hidden
    state per request (engine/layers/mtp.py)."""
    uses = hybrid_layer_states(config.family, dtype)
    if config.num_nextn_predict_layers:
        attention = config.family.attention
        for kind in config.family.mtp_layer_types:
            if kind == "attention":
                uses.append(attention_state(attention.num_kv_heads, attention.head_dim, dtype))
        uses.append(mtp_state(config.hidden_size, dtype))
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    check_hybrid_tp(config.family, size)


def checkpoint_name(name: str) -> str:
    """On-disk NemotronH names use `backbone.`; baton's modules use `model.`."""
    if name.startswith("backbone."):
        return "model." + name[len("backbone.") :]
    return name


HF_CONFIG_CLASS_PATH = "transformers.models.nemotron_h.configuration_nemotron_h.NemotronHConfig"

PATTERN_CHARS: dict[str, LayerType] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPE_NAMES: dict[str, LayerType] = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
# Legacy NemotronH keys and the names transformers uses today.
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_chunk_size": "chunk_size",
    "mamba_expand": "expand",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_d_state": "ssm_state_size",
    "mamba_headdim": "mamba_head_dim",
    "mamba_nheads": "mamba_num_heads",
    "rms_norm_eps": "layer_norm_epsilon",
}


def read_config(reader: ConfigReader) -> ModelConfig:
    hf = dict(reader.hf)
    for legacy, name in ALIASES.items():
        if legacy in hf and name not in hf:
            hf[name] = hf.pop(legacy)
    r = ConfigReader(hf, reader.source, reader.defaults)
    need, opt = r.need, r.opt
    layer_types = _layer_types(hf, r.source)
    num_mtp = int(opt("num_nextn_predict_layers") or 0)
    mtp_types = _mtp_layer_types(hf, r.source, num_mtp)
    all_types = layer_types + mtp_types
    hidden = need("hidden_size")
    num_heads = need("num_attention_heads")
    if "mamba_num_heads" not in hf and "mamba" in layer_types:
        raise r.error("missing required key 'mamba_num_heads'")
    # transformers turns an explicit null into num_attention_heads (a missing key is 8).
    kv_heads = opt("num_key_value_heads")
    kv_heads = num_heads if kv_heads is None else kv_heads
    r.require("mlp_hidden_act", ("relu2",))
    r.require("mamba_hidden_act", ("silu",))
    if "attention" in all_types:
        r.require_multiple("num_attention_heads", num_heads, "num_key_value_heads", kv_heads)
    if "mamba" in layer_types:
        r.require_multiple("mamba_num_heads", opt("mamba_num_heads"), "n_groups", opt("n_groups"))
    head_dim = opt("head_dim") or hidden // num_heads
    # transformers' Mamba mixer builds in_proj/out_proj with `use_bias` (its
    # `mamba_proj_bias` key is read by nothing); a legacy file may only have the latter.
    mamba_bias = bool(hf["use_bias"] if "use_bias" in hf else opt("mamba_proj_bias"))
    ssm_cache_dtype = r.require("mamba_ssm_cache_dtype", (None, "float32", "bfloat16", "float16"))
    norm_eps = float(need("layer_norm_epsilon"))
    hybrid = NemotronHConfig(
        layer_types=layer_types,
        mtp_layer_types=mtp_types,
        norm_eps=norm_eps,
        attention=AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            bias=False,  # transformers' NemotronH attention has none, whatever the key says
            scale=head_dim**-0.5,
            rotary=None,  # NemotronH attention is NoPE
            key_multiplier=1.0,
        )
        if "attention" in all_types
        else None,
        mamba=Mamba2Config(
            num_heads=opt("mamba_num_heads"),
            head_dim=opt("mamba_head_dim"),
            state_size=opt("ssm_state_size"),
            n_groups=opt("n_groups"),
            conv_kernel=opt("conv_kernel"),
            chunk_size=opt("chunk_size"),
            conv_bias=bool(opt("use_conv_bias")),
            proj_bias=mamba_bias,
            out_proj_bias=mamba_bias,
            time_step_limit=r.time_step_limit(),
            norm="gated",
            norm_eps=norm_eps,
            cache_dtype=ssm_cache_dtype or "float32",
            in_multiplier=1.0,
            multipliers=(1.0,) * 5,
        )
        if "mamba" in layer_types
        else None,
        intermediate_size=need("intermediate_size"),
        mlp_bias=bool(opt("mlp_bias")),
        mlp_hidden_act=opt("mlp_hidden_act"),
        moe=_moe_config(r) if "moe" in all_types else None,
    )
    return ModelConfig(
        architecture="NemotronHForCausalLM",
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(opt("tie_word_embeddings")),
        max_position_embeddings=need("max_position_embeddings"),
        num_nextn_predict_layers=num_mtp,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=hybrid,
    )


def _moe_config(r: ConfigReader) -> MoEConfig:
    """NemotronH's MoE keys, each checked against what transformers' block can build."""
    opt, source = r.opt, r.source
    num_experts = int(opt("n_routed_experts"))
    top_k = int(opt("num_experts_per_tok"))
    n_group, topk_group = int(opt("n_group")), int(opt("topk_group"))
    if opt("n_shared_experts") != 1:
        # transformers' NemotronH builds exactly one shared expert whatever this key says.
        raise ConfigError(
            f"{source}: n_shared_experts={opt('n_shared_experts')!r} is not supported "
            "(NemotronH has exactly one shared expert)"
        )
    if n_group < 1 or num_experts % n_group:
        raise ConfigError(f"{source}: n_group={n_group} must divide n_routed_experts={num_experts}")
    if n_group > 1 and num_experts // n_group < 2:
        raise ConfigError(
            f"{source}: n_group={n_group} leaves fewer than 2 experts per group "
            "(a group's score is the sum of its two best experts)"
        )
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{source}: topk_group={topk_group} must be in 1..n_group={n_group}")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} must be in 1..{topk_group * num_experts // n_group}"
            f" (the experts of topk_group={topk_group} of n_group={n_group} groups)"
        )
    latent = opt("moe_latent_size")
    return MoEConfig(
        router="sigmoid_grouped",
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(opt("moe_intermediate_size")),
        shared_intermediate_size=int(opt("moe_shared_expert_intermediate_size")),
        latent_size=None if latent is None else int(latent),
        activation="relu2",
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(opt("norm_topk_prob")),
        norm_topk_eps=1e-20,
        expert_bias=True,
        routed_scaling_factor=float(opt("routed_scaling_factor")),
        bias=bool(opt("mlp_bias")),
        shared_expert_gate=False,
    )


def _mtp_layer_types(hf: dict[str, Any], source: str, num_mtp: int) -> tuple[LayerType, ...]:
    """The block kinds of the MTP layer: `mtp_layers_block_type`, else the legacy
    `mtp_hybrid_override_pattern`, else transformers' default (attention then MoE)."""
    if num_mtp == 0:
        return ()
    if num_mtp != 1:
        raise ConfigError(
            f"{source}: num_nextn_predict_layers={num_mtp} is not supported (baton runs one MTP"
            " layer, chained for every draft, as vLLM's nemotron_h_mtp)"
        )
    if hf.get("mtp_layers_block_type"):
        key, names = "mtp_layers_block_type", hf["mtp_layers_block_type"]
        unknown = sorted({n for n in names if n not in BLOCK_TYPE_NAMES})
        kinds = tuple(BLOCK_TYPE_NAMES.get(n) for n in names)
    elif hf.get("mtp_hybrid_override_pattern"):
        key, names = "mtp_hybrid_override_pattern", hf["mtp_hybrid_override_pattern"]
        unknown = sorted({c for c in names if c not in PATTERN_CHARS})
        kinds = tuple(PATTERN_CHARS.get(c) for c in names)
    else:
        return ("attention", "moe")
    unsupported = sorted({str(n) for n, k in zip(names, kinds) if k not in MTP_BLOCK_TYPES})
    if unknown or unsupported:
        raise ConfigError(
            f"{source}: {key!r} has block types {unknown or unsupported} an MTP layer cannot"
            " hold (attention and MoE blocks, as vLLM's nemotron_h_mtp)"
        )
    return kinds


def _layer_types(hf: dict[str, Any], source: str) -> tuple[LayerType, ...]:
    if hf.get("layers_block_type"):
        names = hf["layers_block_type"]
        unknown = sorted({n for n in names if n not in BLOCK_TYPE_NAMES})
        if unknown:
            raise ConfigError(f"{source}: 'layers_block_type' has unknown block types {unknown}")
        return tuple(BLOCK_TYPE_NAMES[n] for n in names)
    if hf.get("hybrid_override_pattern"):
        pattern = hf["hybrid_override_pattern"]
        unknown = sorted({c for c in pattern if c not in PATTERN_CHARS})
        if unknown:
            raise ConfigError(
                f"{source}: 'hybrid_override_pattern' has unknown characters {unknown}"
            )
        return tuple(PATTERN_CHARS[c] for c in pattern)
    raise ConfigError(
        f"{source}: missing required key 'hybrid_override_pattern' or 'layers_block_type'"
    )


class Block(nn.Module):
    def __init__(self, hidden_size: int, config: HybridConfig, kind: LayerType, pool_index: int):
        """pool_index: the layer's index among the layers of its state kind (Mamba or KV)."""
        super().__init__()
        self.norm = RMSNorm(hidden_size, config.norm_eps)
        # Mamba and attention read and write the pools; MLP and MoE see only their rows.
        self.stateful = kind in ("mamba", "attention")
        if kind == "mamba":
            self.mixer = Mamba2Mixer(hidden_size, config.mamba, pool_index)
        elif kind == "attention":
            self.mixer = Attention.from_config(hidden_size, config.attention, pool_index)
        elif kind == "mlp":
            self.mixer = ReluSquaredMLP(hidden_size, config.intermediate_size, config.mlp_bias)
        else:
            assert config.moe is not None  # read_config builds it whenever a layer is `moe`
            self.mixer = MoE(hidden_size, config.moe)

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        normed = self.norm(hidden)
        out = self.mixer(normed, md, cache) if self.stateful else self.mixer(normed)
        return hidden + out


def _pool_index(config: HybridConfig, layer_id: int) -> int:
    kind = config.layer_types[layer_id]
    if kind == "mamba":
        return config.mamba_layer_ids.index(layer_id)
    if kind == "attention":
        return config.attention_layer_ids.index(layer_id)
    return 0


class MTPBlock(Block):
    """One block of the MTP layer; the first fuses the next token's embedding with the target's
    hidden state (enorm, hnorm, eh_proj), the last ends with final_layernorm."""

    def __init__(
        self,
        hidden_size: int,
        config: NemotronHConfig,
        kind: LayerType,
        pool_index: int,
        *,
        first: bool,
        last: bool,
    ):
        super().__init__(hidden_size, config, kind, pool_index)
        if first:
            self.enorm = RMSNorm(hidden_size, config.norm_eps)
            self.hnorm = RMSNorm(hidden_size, config.norm_eps)
            self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        if last:
            self.final_layernorm = RMSNorm(hidden_size, config.norm_eps)


class NemotronHMTP(nn.Module):
    """The MTP layer (engine/layers/mtp.py): x = eh_proj(cat(enorm(embeds), hnorm(hidden))),
    then its blocks (pre-norm, residual), then final_layernorm."""

    def __init__(self, hidden_size: int, config: NemotronHConfig):
        super().__init__()
        kinds = config.mtp_layer_types
        first_kv = len(config.attention_layer_ids)  # the MTP's K/V pools follow the model's
        kv_index = [first_kv + kinds[:j].count("attention") for j in range(len(kinds))]
        self.layers = nn.ModuleList(
            MTPBlock(
                hidden_size,
                config,
                kind,
                kv_index[j] if kind == "attention" else 0,
                first=j == 0,
                last=j == len(kinds) - 1,
            )
            for j, kind in enumerate(kinds)
        )

    def forward(
        self, embeds: torch.Tensor, prev_hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache
    ) -> torch.Tensor:
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(prev_hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, md, cache)
        return self.layers[-1].final_layernorm(x)


class NemotronHModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hybrid = config.family
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config.hidden_size, hybrid, kind, _pool_index(hybrid, i))
            for i, kind in enumerate(hybrid.layer_types)
        )
        self.norm_f = RMSNorm(config.hidden_size, hybrid.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embeddings(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm_f(hidden)


class NemotronHForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        mtp = (
            NemotronHMTP(config.hidden_size, config.family)
            if config.num_nextn_predict_layers
            else None
        )
        super().__init__(config, NemotronHModel(config), "embeddings", mtp=mtp)


Model = NemotronHForCausalLM
