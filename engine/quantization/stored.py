"""What a checkpoint stores for one weight, read from the safetensors headers before anything
is loaded: every tensor's dtype and shape (`checkpoint_headers`), whether a weight is stored
quantized and in which scheme, checked against the config (`stored_scheme`), and the shape this
rank holds, every stored tensor checked against the scheme (`checked_shape`). Errors name the
tensor and the config key (WeightError)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from baton.engine.checkpoint.weights import Rename, checkpoint_files
from baton.engine.parallel import Slices, shard_rule
from baton.engine.quantization.config import LayerScheme, QuantConfig
from baton.engine.quantization.schemes import WeightError, WeightShape, check_header, tensor_specs

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2")
QUANTIZED_DTYPES = ("F8_E4M3", "U8")


@dataclass(frozen=True, kw_only=True, slots=True)
class Header:
    dtype: str  # safetensors' code: F32, BF16, F8_E4M3, U8, ...
    shape: tuple[int, ...]


def checkpoint_headers(model_dir: str | Path, rename: Rename) -> dict[str, Header]:
    """Every tensor's dtype and shape by model name (headers only, nothing read)."""
    headers: dict[str, Header] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                renamed = rename(name)
                if renamed is not None:
                    part = shard.get_slice(name)
                    headers[renamed] = Header(dtype=part.get_dtype(), shape=tuple(part.get_shape()))
    return headers


def stored_scheme(
    name: str,
    matrices: list[str],
    quant: QuantConfig,
    headers: dict[str, Header],
    left: list[str],
) -> LayerScheme | None:
    """The scheme of the weight `name` whose checkpoint tensors are `matrices` (one, or one per
    expert and part), None to leave it as it is (stored unquantized: noted in `left` when the
    config would quantize it). WeightError when its matrices are stored unlike each other or
    unlike the config."""
    stored = [m for m in matrices if f"{m}.weight" in headers]
    if not stored:
        return None  # not in the checkpoint: the loader reports it missing
    quantized = [
        m
        for m in stored
        if headers[f"{m}.weight"].dtype in QUANTIZED_DTYPES
        or any(f"{m}.{s}" in headers for s in SCALE_SUFFIXES)
    ]
    per_matrix = [quant.scheme_for(m) for m in stored]
    schemes = {None if s is None else (s.algo, s.block) for s in per_matrix}
    if not quantized:
        if schemes != {None}:
            left.append(name)
        return None
    if len(quantized) != len(stored):
        raise WeightError(
            f"tensor {quantized[0]}.weight is quantized but {sorted(set(stored) - set(quantized))[0]}"
            f".weight is not: the experts of {name} must be stored alike"
        )
    if len(schemes) != 1 or None in schemes:
        first = next((m for m in stored if quant.scheme_for(m) is None), None)
        if first is None:
            raise WeightError(
                f"{quant.source}: the experts of {name} are listed with different quant_algo "
                f"({sorted(a for a, _ in schemes)}); one stack is stored one way"
            )
        pattern = quant.excluded(first)
        why = (
            f"{quant.exclude_key} lists {pattern!r}"
            if pattern is not None
            else ("it is not in quantized_layers")
        )
        raise WeightError(
            f"tensor {first}.weight is stored quantized, but {quant.source} leaves {first} "
            f"unquantized ({why})"
        )
    return per_matrix[0]


def checked_shape(
    matrices: list[str],
    lead: tuple[int, ...],
    local: tuple[int, int],
    rule: Slices | None,
    scheme: LayerScheme,
    quant: QuantConfig,
    headers: dict[str, Header],
) -> tuple[WeightShape, tuple[int, ...] | None]:
    """The shape of a weight this rank holds as (n, k) = `local`, sliced by `rule`, and its FP8
    scale shape, once every stored tensor's dtype and shape is checked against `scheme`
    (WeightError naming tensor and key)."""
    stored = [m for m in matrices if f"{m}.weight" in headers]
    shape = _weight_shape(local, rule, headers[f"{stored[0]}.weight"], scheme)
    scale = headers.get(f"{stored[0]}.weight_scale")
    scale_shape = scale.shape[len(lead) :] if scale is not None else None
    for matrix in stored:
        for spec in tensor_specs(scheme, shape, scale_shape):
            tensor = f"{matrix}.{spec.suffix}"
            if tensor not in headers:
                raise WeightError(
                    f"tensor {tensor!r} is missing: {quant.source} {scheme.key} ({scheme.algo}) "
                    f"stores it beside {matrix}.weight"
                )
            found = headers[tensor]
            check_header(tensor, spec, found.dtype, found.shape, lead, scheme, quant.source)
    return shape, scale_shape


def matrix_rule(weight: torch.Tensor) -> Slices | None:
    """The weight's tensor-parallel slice on its last two dims (-2: rows, -1: inputs)."""
    rule = shard_rule(weight)
    if not isinstance(rule, Slices):
        return None
    on_rows = rule.dim % weight.dim() == weight.dim() - 2
    return Slices(dim=-2 if on_rows else -1, ranges=rule.ranges)


def _weight_shape(
    local: tuple[int, int], rule: Slices | None, header: Header, scheme: LayerScheme
) -> WeightShape:
    """The whole model's (N, K) (the checkpoint's along the sliced axis) and this rank's."""
    n, k = local
    stored_n, stored_cols = header.shape[-2:]
    stored_k = stored_cols * 2 if scheme.algo == "NVFP4" else stored_cols
    if rule is None:
        return WeightShape(full=(n, k), local=(n, k), rule=None)
    full = (stored_n, k) if rule.dim == -2 else (n, stored_k)
    return WeightShape(full=full, local=(n, k), rule=rule)
