"""ModelConfig: a frozen, complete description of a NemotronH checkpoint, read from config.json.

No defaults of baton's own: every field comes from the file (or from a documented alias /
derivation). A key the shapes cannot be guessed without (`hidden_size`, the layer layout...) is
required and its absence is an error that names it; any other missing key takes the default of
transformers' `NemotronHConfig` (read from the class, so the two cannot drift), because that is
what transformers would run the same directory with. A key whose value baton cannot honour is a
`ConfigError` that names it. Defaults for *serving* live at the CLI boundary.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

LayerType = Literal["mamba", "attention", "mlp", "moe"]

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
SUPPORTED_ARCHITECTURES = ("NemotronHForCausalLM",)


class ConfigError(ValueError):
    """A model directory whose config.json cannot be served; the message names the key."""


@functools.cache
def transformers_defaults() -> dict[str, Any]:
    """Keyword defaults of transformers' `NemotronHConfig.__init__`: what a key missing from
    config.json means to the reference implementation."""
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    return {
        name: param.default
        for name, param in inspect.signature(NemotronHConfig.__init__).parameters.items()
        if param.default is not inspect.Parameter.empty
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """A routed mixture of experts plus one always-on shared expert (NemotronH's `moe` block).

    Router: sigmoid scores of a float32 linear; top-k choice on scores + `e_score_correction_bias`
    restricted to the best `topk_group` of `n_group` expert groups (a group's score is the sum
    of its two best experts); weights are the chosen sigmoid scores, renormalised to sum 1 when
    `norm_topk_prob`, times `routed_scaling_factor`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    shared_intermediate_size: int  # the shared expert (an MLP beside the routed ones)
    # Experts run in a smaller space: fc1_latent_proj (hidden -> latent) before them and
    # fc2_latent_proj (latent -> hidden) after (Nemotron 3 Super). None: no projection.
    latent_size: int | None
    activation: Literal["relu2", "swiglu"]  # relu2: up/down experts; swiglu: gate_up/down
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    bias: bool  # bias of the shared expert and latent projections (`mlp_bias`)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[LayerType, ...]
    norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    # MLP
    intermediate_size: int
    mlp_bias: bool
    mlp_hidden_act: str
    # Mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    mamba_ssm_cache_dtype: str
    # MoE: None when no layer is a `moe` block (then no MoE key is read or checked)
    moe: MoEConfig | None
    # Multi-token-prediction layers stored in the checkpoint (`mtp.*`); baton does not run them
    # yet, the loader skips their weights.
    num_nextn_predict_layers: int
    # tokens
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mamba")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "attention")

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{model_dir}: no config.json (expected a Hugging Face model directory)"
            )
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        hf = dict(raw)
        for legacy, name in ALIASES.items():
            if legacy in hf and name not in hf:
                hf[name] = hf.pop(legacy)

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return hf[key]

        defaults = transformers_defaults()

        def opt(key: str) -> Any:
            """The file's value, else transformers' default for NemotronH."""
            return hf[key] if key in hf else defaults[key]

        architectures = hf.get("architectures") or [hf.get("model_type", "")]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES and hf.get("model_type") != "nemotron_h":
            raise ConfigError(
                f"{source}: unsupported architecture {arch!r} (key 'architectures'); "
                f"baton serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        layer_types = _layer_types(hf, source)
        hidden = need("hidden_size")
        num_heads = need("num_attention_heads")
        eos = need("eos_token_id")
        limit = opt("time_step_limit")
        limit = tuple(math.inf if isinstance(v, dict) or v is None else float(v) for v in limit)
        if "mamba_num_heads" not in hf and "mamba" in layer_types:
            raise ConfigError(f"{source}: missing required key 'mamba_num_heads'")
        # transformers turns an explicit null into num_attention_heads (a missing key is 8).
        kv_heads = opt("num_key_value_heads")
        for key, supported in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if opt(key) != supported:
                raise ConfigError(
                    f"{source}: {key}={opt(key)!r} is not supported (baton runs {supported!r})"
                )
        return cls(
            architecture="NemotronHForCausalLM",
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            layer_types=layer_types,
            norm_eps=float(need("layer_norm_epsilon")),
            tie_word_embeddings=bool(opt("tie_word_embeddings")),
            max_position_embeddings=need("max_position_embeddings"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads if kv_heads is None else kv_heads,
            head_dim=opt("head_dim") or hidden // num_heads,
            attention_bias=bool(opt("attention_bias")),
            intermediate_size=need("intermediate_size"),
            mlp_bias=bool(opt("mlp_bias")),
            mlp_hidden_act=opt("mlp_hidden_act"),
            mamba_num_heads=opt("mamba_num_heads"),
            mamba_head_dim=opt("mamba_head_dim"),
            ssm_state_size=opt("ssm_state_size"),
            n_groups=opt("n_groups"),
            conv_kernel=opt("conv_kernel"),
            chunk_size=opt("chunk_size"),
            use_conv_bias=bool(opt("use_conv_bias")),
            # transformers' Mamba mixer builds in_proj/out_proj with `use_bias` (its
            # `mamba_proj_bias` key is read by nothing); a legacy file may only have the latter.
            mamba_proj_bias=bool(hf["use_bias"] if "use_bias" in hf else opt("mamba_proj_bias")),
            time_step_limit=(limit[0], limit[1]),
            mamba_ssm_cache_dtype=opt("mamba_ssm_cache_dtype") or "float32",
            moe=_moe_config(hf, opt, source) if "moe" in layer_types else None,
            num_nextn_predict_layers=int(opt("num_nextn_predict_layers") or 0),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
            bos_token_id=opt("bos_token_id"),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype") or "bfloat16",
        )


def _moe_config(hf: dict[str, Any], opt, source: str) -> MoEConfig:
    """NemotronH's MoE keys, each checked against what transformers' block can build."""
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
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(opt("moe_intermediate_size")),
        shared_intermediate_size=int(opt("moe_shared_expert_intermediate_size")),
        latent_size=None if latent is None else int(latent),
        activation="relu2",
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(opt("norm_topk_prob")),
        routed_scaling_factor=float(opt("routed_scaling_factor")),
        bias=bool(opt("mlp_bias")),
    )


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
