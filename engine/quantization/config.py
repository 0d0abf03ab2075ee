"""A checkpoint's quantization, read once per model from `config.json`'s `quantization_config`
(else ModelOpt's `hf_quant_config.json`), reconciled with `--quantization` (vLLM's spellings).

    config.json quantization_config                       hf_quant_config.json
      quant_method "modelopt", quant_algo, ignore,          quantization: quant_algo,
        kv_cache_scheme, group_size, quantized_layers         exclude_modules, kv_cache_quant_algo,
      quant_method "fp8", weight_block_size, fmt,             group_size, quantized_layers
        activation_scheme, modules_to_not_convert

What each layer's tensors hold (`LayerScheme`):
    FP8            e4m3 weight, one float32 weight_scale per tensor (or per output row: ModelOpt's
                   FP8_PER_CHANNEL_PER_TOKEN; fine-grained FP8 without weight_block_size)
    FP8_BLOCK      e4m3 weight, float32 weight_scale_inv per (rows x inputs) block, multiplied
                   despite its name; the edge blocks may be partial (scale shape: ceil division)
    NVFP4          uint8 weight (two e2m1 per byte), e4m3 weight_scale per 16 inputs, float32
                   weight_scale_2 per tensor (ModelOpt's NVFP4 and W4A16_NVFP4 store the same)
ModelOpt's MIXED_PRECISION names one of FP8 / NVFP4 per layer in `quantized_layers`.

Layer names in the config are the checkpoint's; they are turned into the model's own names with
the family's `checkpoint_name` (a NemotronH `backbone.` becomes `model.`), patterns included.
Anything baton does not load is refused naming the key and its value.
"""

from __future__ import annotations

import fnmatch
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from baton.engine.config import QUANTIZATION_NAMES
from baton.engine.config_error import ConfigError

# --quantization as vLLM spells it; None: whatever the checkpoint says
HF_QUANT_CONFIG = "hf_quant_config.json"
MODELOPT_ALGOS = {
    "FP8": "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8",
    "NVFP4": "NVFP4",
    "W4A16_NVFP4": "NVFP4",
}
# vLLM's method name for a ModelOpt checkpoint of each top-level quant_algo
MODELOPT_METHODS = {"FP8": "modelopt", "NVFP4": "modelopt_fp4", "MIXED_PRECISION": "modelopt_mixed"}

Algo = Literal["FP8", "FP8_BLOCK", "NVFP4"]
Method = Literal["fp8", "modelopt", "modelopt_fp4", "modelopt_mixed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerScheme:
    """How one layer's weight is stored; `key` names the config entry that says so (errors)."""

    algo: Algo
    block: tuple[int, int] | None  # FP8_BLOCK: (rows, inputs) per scale
    key: str


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantConfig:
    method: Method  # vLLM's name for it
    source: str  # where it was read ("--quantization fp8" for online quantization)
    default: LayerScheme | None  # every layer not excluded (None: only `per_layer`)
    per_layer: Mapping[str, LayerScheme]  # MIXED_PRECISION, by model name
    exclude: tuple[str, ...]  # model-name patterns left unquantized
    exclude_key: str
    kv_cache: str | None  # the checkpoint's KV cache algorithm (K/V stay in the model dtype)
    online: bool  # quantize an unquantized checkpoint at load (FP8, one scale per tensor)

    def scheme_for(self, name: str) -> LayerScheme | None:
        """The scheme of the layer at model name `name` (an expert's own name for a MoE),
        None when the config leaves it unquantized."""
        if self.excluded(name) is not None:
            return None
        for prefix in reversed(_dotted_prefixes(name)):  # the most specific entry listed
            if prefix in self.per_layer:
                return self.per_layer[prefix]
        return self.default

    def excluded(self, name: str) -> str | None:
        """The exclude pattern that matches `name`, if any: the module itself or a parent
        (`lm_head`, `model.layers.0`), a wildcard (`*.conv1d`, `model.layers.1*`), or a suffix at
        a module boundary (transformers' `modules_to_not_convert`)."""
        names, wildcards = _pattern_index(self.exclude)
        parts = name.split(".")
        suffixes = [".".join(parts[i:]) for i in range(1, len(parts))]
        for candidate in _dotted_prefixes(name) + suffixes:
            if candidate in names:
                return candidate
        for pattern in wildcards:
            if (
                name.startswith(pattern + ".")
                or name.endswith("." + pattern)
                or fnmatch.fnmatchcase(name, pattern)
            ):
                return pattern
        return None


# Qwen's FP8 releases list every module they keep (~500 names) and a MoE checks tens of
# thousands of expert matrices: names are looked up, only wildcards are matched one by one (the
# cache's key, a tuple of strings, hashes fast).
@functools.lru_cache(maxsize=16)
def _pattern_index(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    wildcards = tuple(p for p in patterns if any(c in p for c in "*?["))
    return frozenset(patterns).difference(wildcards), wildcards


def _dotted_prefixes(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`, `a.b.c`]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def read_quantization(model_dir: str | Path, requested: str | None, rename) -> QuantConfig | None:
    """The model's quantization: the checkpoint's, checked against `requested` (--quantization),
    or online FP8 for `requested="fp8"` on an unquantized checkpoint; None for neither.
    rename: the family's checkpoint_name (checkpoint names -> model names, None: skipped)."""
    if requested is not None and requested not in QUANTIZATION_NAMES:
        raise ConfigError(
            f"--quantization {requested!r} is not supported: expected one of "
            f"{', '.join(QUANTIZATION_NAMES)}"
        )
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    raw, source = config.get("quantization_config"), f"{root / 'config.json'}: quantization_config"
    if raw is None and (root / HF_QUANT_CONFIG).is_file():
        raw, source = json.loads((root / HF_QUANT_CONFIG).read_text()), str(root / HF_QUANT_CONFIG)
    if raw is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise ConfigError(
                f"--quantization {requested} needs a checkpoint quantized with it ({root} has no "
                f"quantization_config and no {HF_QUANT_CONFIG}); only fp8 quantizes at load"
            )
        return online_fp8()
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected an object, got {type(raw).__name__}")
    method = str(raw.get("quant_method", "modelopt" if "quantization" in raw else "")).lower()
    if method == "modelopt":
        quant = _modelopt(raw, source, rename)
    elif method == "fp8":
        quant = _fine_grained_fp8(raw, source, rename)
    else:
        raise ConfigError(
            f"{source}: quant_method {raw.get('quant_method')!r} is not supported; baton loads "
            "'fp8' (fine-grained or per-tensor FP8) and 'modelopt' (FP8, NVFP4, MIXED_PRECISION)"
        )
    if requested not in (None, quant.method) and not (
        requested == "modelopt" and quant.method.startswith("modelopt")
    ):
        raise ConfigError(
            f"--quantization {requested} does not match the checkpoint's quantization "
            f"({quant.method}, from {source})"
        )
    return quant


def online_fp8() -> QuantConfig:
    return QuantConfig(
        method="fp8",
        source="--quantization fp8",
        default=LayerScheme(algo="FP8", block=None, key="--quantization fp8"),
        per_layer={},
        exclude=(),
        exclude_key="",
        kv_cache=None,
        online=True,
    )


def _modelopt(raw: dict[str, Any], source: str, rename) -> QuantConfig:
    nested = raw.get("quantization")
    if nested is not None:  # hf_quant_config.json
        if not isinstance(nested, dict):
            raise ConfigError(f"{source}: 'quantization' must be an object")
        body, prefix = nested, "quantization."
        exclude_key, kv_cache = f"{prefix}exclude_modules", nested.get("kv_cache_quant_algo")
        exclude = nested.get("exclude_modules") or []
    else:  # config.json's quantization_config
        body, prefix = raw, ""
        exclude_key, exclude = "ignore", raw.get("ignore") or []
        scheme = raw.get("kv_cache_scheme")
        kv_cache = (
            f"{scheme.get('type')}{scheme.get('num_bits')}" if isinstance(scheme, dict) else None
        )
    algo = str(body.get("quant_algo") or "").upper()
    key = f"{prefix}quant_algo"
    group = body.get("group_size")
    if group is not None and int(group) != 16:
        raise ConfigError(f"{source}: {prefix}group_size={group!r} is not supported (NVFP4: 16)")
    if not isinstance(exclude, list):
        raise ConfigError(f"{source}: {exclude_key} must be a list")
    per_layer: dict[str, LayerScheme] = {}
    default = None
    if algo == "MIXED_PRECISION":
        layers = body.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise ConfigError(
                f"{source}: {key} MIXED_PRECISION needs a non-empty {prefix}quantized_layers"
            )
        for name, entry in layers.items():
            entry_key = f"{prefix}quantized_layers[{name!r}].quant_algo"
            value = str((entry or {}).get("quant_algo", "")).upper()
            if value not in MODELOPT_ALGOS:
                raise ConfigError(f"{source}: {entry_key} {value!r} is not supported")
            model_name = rename(name)
            if model_name is not None:
                per_layer[model_name] = LayerScheme(
                    algo=MODELOPT_ALGOS[value], block=None, key=entry_key
                )
    elif algo in MODELOPT_ALGOS:
        default = LayerScheme(algo=MODELOPT_ALGOS[algo], block=None, key=key)
    else:
        raise ConfigError(
            f"{source}: {key} {body.get('quant_algo')!r} is not supported; baton loads "
            f"{', '.join([*MODELOPT_ALGOS, 'MIXED_PRECISION'])}"
        )
    return QuantConfig(
        method=MODELOPT_METHODS.get(algo) or MODELOPT_METHODS[MODELOPT_ALGOS[algo]],
        source=source,
        default=default,
        per_layer=per_layer,
        exclude=_model_patterns(exclude, rename),
        exclude_key=exclude_key,
        kv_cache=None if kv_cache is None else str(kv_cache),
        online=False,
    )


def _fine_grained_fp8(raw: dict[str, Any], source: str, rename) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: fmt {fmt!r} is not supported (FP8 checkpoints: e4m3)")
    scheme_key = "activation_scheme"
    if raw.get(scheme_key, "dynamic") not in ("dynamic", "static"):
        raise ConfigError(f"{source}: {scheme_key} {raw.get(scheme_key)!r} is not supported")
    block = raw.get("weight_block_size")
    if block is not None:
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ConfigError(f"{source}: weight_block_size {block!r} is not two positive ints")
        scheme = LayerScheme(algo="FP8_BLOCK", block=(block[0], block[1]), key="weight_block_size")
    else:
        scheme = LayerScheme(algo="FP8", block=None, key="quant_method")
    exclude_key = "modules_to_not_convert" if "modules_to_not_convert" in raw else "ignored_layers"
    exclude = raw.get(exclude_key) or []
    if not isinstance(exclude, list):
        raise ConfigError(f"{source}: {exclude_key} must be a list")
    return QuantConfig(
        method="fp8",
        source=source,
        default=scheme,
        per_layer={},
        exclude=_model_patterns(exclude, rename),
        exclude_key=exclude_key,
        kv_cache=None,
        online=False,
    )


def _model_patterns(patterns: list[str], rename) -> tuple[str, ...]:
    """Checkpoint-name patterns in model names (a pattern the family skips is dropped); the
    checkpoint spelling is kept too, for patterns written without the prefix."""
    out: list[str] = []
    for pattern in patterns:
        renamed = rename(str(pattern))
        for candidate in (renamed, str(pattern)):
            if candidate is not None and candidate not in out:
                out.append(candidate)
    return tuple(out)
