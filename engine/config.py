"""ModelConfig: a frozen, complete description of a NemotronH checkpoint, read from config.json.

No defaults: every field comes from the file (or from a documented alias / derivation), and a
missing key is an error that names it. Defaults for *serving* live at the CLI boundary.
"""

from __future__ import annotations

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
        head_dim = hf.get("head_dim") or hidden // num_heads
        eos = need("eos_token_id")
        limit = hf.get("time_step_limit", (0.0, math.inf))
        limit = tuple(math.inf if isinstance(v, dict) or v is None else float(v) for v in limit)
        if "mamba_num_heads" not in hf and "mamba" in layer_types:
            raise ConfigError(f"{source}: missing required key 'mamba_num_heads'")
        return cls(
            architecture="NemotronHForCausalLM",
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            layer_types=layer_types,
            norm_eps=float(need("layer_norm_epsilon")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=need("max_position_embeddings"),
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            attention_bias=bool(hf.get("attention_bias", False)),
            intermediate_size=need("intermediate_size"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            mlp_hidden_act=hf.get("mlp_hidden_act", "relu2"),
            mamba_num_heads=hf.get("mamba_num_heads", 0),
            mamba_head_dim=hf.get("mamba_head_dim", 0),
            ssm_state_size=hf.get("ssm_state_size", 0),
            n_groups=hf.get("n_groups", 1),
            conv_kernel=hf.get("conv_kernel", 4),
            chunk_size=hf.get("chunk_size", 128),
            use_conv_bias=bool(hf.get("use_conv_bias", True)),
            mamba_proj_bias=bool(hf.get("mamba_proj_bias", hf.get("use_bias", False))),
            time_step_limit=(limit[0], limit[1]),
            mamba_ssm_cache_dtype=hf.get("mamba_ssm_cache_dtype") or "float32",
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype") or "bfloat16",
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
