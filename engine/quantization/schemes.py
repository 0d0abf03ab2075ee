"""The tensors each quantization scheme stores for one weight, checked against the checkpoint's
headers before anything is read, sliced for a tensor-parallel rank without splitting a scale
block, checked for bad values as they load, and turned into the kernels' `QuantizedTensor`.

For a weight of shape (*lead, N, K) (lead: the experts of a stack, else empty):

    scheme      tensor           dtype on disk        shape
    FP8         weight           F8_E4M3              (*lead, N, K)
                weight_scale     F32 (BF16, F16)      (*lead) or (*lead, 1): per tensor
                                                      (*lead, N): per output row
    FP8_BLOCK   weight           F8_E4M3              (*lead, N, K)
                weight_scale_inv F32 (BF16, F16)      (*lead, ceil(N / bn), ceil(K / bk))
    NVFP4       weight           U8                   (*lead, N, K / 2)
                weight_scale     F8_E4M3              (*lead, N, K / 16)
                weight_scale_2   F32                  (*lead) or (*lead, 1)

A rank's slice of a scale follows its weight's slice (engine/parallel Slices) in scale units (a
block, 16 inputs, a byte's two inputs); a slice that would cut one is refused naming the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from baton.engine.config_error import ConfigError
from baton.engine.parallel import Slices
from baton.engine.quantization.config import LayerScheme
from baton.kernels.quant import NVFP4_GROUP, QuantizedTensor

FLOAT_SCALES = ("F32", "BF16", "F16")
TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}
ScaleLayout = Literal["tensor", "row", "block", "group"]


class WeightError(ValueError):
    """A quantized tensor that does not match its scheme; the message names tensor and key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """One stored tensor of a quantized weight: what the checkpoint must hold (per matrix, the
    lead dims excluded) and what this rank's parameter is."""

    suffix: str  # weight, weight_scale, weight_scale_inv, weight_scale_2
    dtypes: tuple[str, ...]  # accepted safetensors dtypes
    param_dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]  # accepted per-matrix shapes (first: the canonical one)
    local_shape: tuple[int, ...]  # this rank's, per matrix
    # weight elements per element of this tensor along the weight's rows / inputs (0: the
    # tensor does not follow that axis, every rank reads it whole)
    row_unit: int
    col_unit: int
    layout: ScaleLayout | None  # None: the weight itself


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightShape:
    """The whole model's (N, K) of one matrix, this rank's (n, k), and the slice between them."""

    full: tuple[int, int]
    local: tuple[int, int]
    rule: Slices | None  # on dim -2 (rows) or -1 (inputs) of the weight, else None


def tensor_specs(
    scheme: LayerScheme, shape: WeightShape, scale_shape: tuple[int, ...] | None
) -> list[TensorSpec]:
    """The stored tensors of `scheme` for one matrix. scale_shape: the checkpoint's shape of the
    FP8 weight_scale (per matrix), which decides per tensor or per row."""
    (N, K), (n, k) = shape.full, shape.local
    g = NVFP4_GROUP
    if scheme.algo == "NVFP4":
        return [
            _spec("weight", ("U8",), torch.uint8, ((N, K // 2),), (n, k // 2), 1, 2, None),
            _spec(
                "weight_scale",
                ("F8_E4M3",),
                torch.float8_e4m3fn,
                ((N, K // g),),
                (n, k // g),
                1,
                g,
                "group",
            ),
            _spec("weight_scale_2", FLOAT_SCALES, torch.float32, ((), (1,)), (), 0, 0, "tensor"),
        ]
    weight = _spec("weight", ("F8_E4M3",), torch.float8_e4m3fn, ((N, K),), (n, k), 1, 1, None)
    if scheme.algo == "FP8_BLOCK":
        bn, bk = scheme.block
        blocks = (-(-N // bn), -(-K // bk))
        local = (-(-n // bn), -(-k // bk))
        return [
            weight,
            _spec(
                "weight_scale_inv", FLOAT_SCALES, torch.float32, (blocks,), local, bn, bk, "block"
            ),
        ]
    if scale_shape == (N,) and N != 1:
        return [
            weight,
            _spec("weight_scale", FLOAT_SCALES, torch.float32, ((N,),), (n,), 1, 0, "row"),
        ]
    return [
        weight,
        _spec("weight_scale", FLOAT_SCALES, torch.float32, ((), (1,)), (), 0, 0, "tensor"),
    ]


def _spec(suffix, dtypes, param_dtype, shapes, local_shape, row_unit, col_unit, layout):
    return TensorSpec(
        suffix=suffix,
        dtypes=dtypes,
        param_dtype=param_dtype,
        shapes=shapes,
        local_shape=local_shape,
        row_unit=row_unit,
        col_unit=col_unit,
        layout=layout,
    )


def split_unit(scheme: LayerScheme, on_rows: bool) -> tuple[int, str]:
    """The weight elements a rank's slice must not cut along rows / inputs, and what they are."""
    if scheme.algo == "FP8_BLOCK":
        bn, bk = scheme.block
        return (bn if on_rows else bk), f"a {bn}x{bk} scale block ({scheme.key} [{bn}, {bk}])"
    if scheme.algo == "NVFP4" and not on_rows:
        return NVFP4_GROUP, f"a group of {NVFP4_GROUP} inputs sharing a scale ({scheme.key} NVFP4)"
    return 1, ""


def scale_rule(
    spec: TensorSpec, shape: WeightShape, scheme: LayerScheme, name: str, size_word: str
) -> Slices | None:
    """This rank's slice of `spec`'s tensor (of module `name`), in the tensor's own units;
    ConfigError when the weight's slice would cut a scale block or an NVFP4 group. size_word:
    what made the slice ("tensor-parallel size 2"), for the message."""
    rule = shape.rule
    if rule is None:
        return None
    on_rows = rule.dim in (0, -2)
    per = spec.row_unit if on_rows else spec.col_unit
    if per == 0:
        return None
    unit, what = split_unit(scheme, on_rows)
    full = shape.full[0] if on_rows else shape.full[1]
    for start, length in rule.ranges:
        if start % unit or (length % unit and start + length < full):
            side = "rows" if on_rows else "inputs"
            raise ConfigError(
                f"{name}.{spec.suffix}: {size_word} would split {what}: this rank's {side} "
                f"[{start}, {start + length}) of {full} do not start and end on multiples of {unit}"
            )
    ranges = tuple((start // per, -(-length // per)) for start, length in rule.ranges)
    dim = (-2 if on_rows else -1) if len(spec.local_shape) == 2 else -1
    return Slices(dim=dim, ranges=ranges)


def check_header(
    name: str,
    spec: TensorSpec,
    dtype: str,
    shape: tuple[int, ...],
    lead: tuple[int, ...],
    scheme: LayerScheme,
    source: str,
) -> None:
    """WeightError unless the checkpoint's header for `name` fits `spec` (with `lead` dims)."""
    if dtype not in spec.dtypes:
        raise WeightError(
            f"tensor {name!r} has dtype {dtype}; {source} {scheme.key} ({scheme.algo}) stores "
            f"{spec.suffix} as {' or '.join(spec.dtypes)}"
        )
    accepted = [(*lead, *s) for s in spec.shapes]
    if tuple(shape) not in accepted:
        detail = f" for weight_block_size {list(scheme.block)}" if scheme.block else ""
        raise WeightError(
            f"tensor {name!r} has shape {tuple(shape)}; {source} {scheme.key} ({scheme.algo}) "
            f"expects {accepted[0]}{detail}"
        )


def check_values(name: str, tensor: torch.Tensor, spec: TensorSpec, key: str) -> torch.Tensor:
    """The loaded tensor, reshaped to the parameter's form; WeightError for NaN codes or scales
    that are NaN, infinite or negative."""
    if spec.param_dtype == torch.float8_e4m3fn:
        codes = tensor.view(torch.uint8)
        if bool(((codes & 0x7F) == 0x7F).any()):
            raise WeightError(f"tensor {name!r} holds e4m3 NaN codes (0x7f/0xff) ({key})")
        if spec.layout is None:
            return tensor
    if spec.layout is not None and tensor.is_floating_point():
        values = tensor.float()
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise WeightError(
                f"tensor {name!r}: scales must be finite and >= 0, found "
                f"{values[~torch.isfinite(values) | (values < 0)].flatten()[:4].tolist()} ({key})"
            )
    if spec.layout == "tensor" and tensor.dim() and tensor.shape[-1] == 1:
        return tensor.squeeze(-1)
    return tensor


def quantized_tensor(
    scheme: LayerScheme, tensors: dict[str, torch.Tensor], local: tuple[int, int]
) -> QuantizedTensor:
    """The kernels' per-row form of one rank's loaded tensors (lead dims kept)."""
    n, k = local
    weight = tensors["weight"]
    lead = weight.shape[:-2]
    if scheme.algo == "NVFP4":
        scale_2 = tensors["weight_scale_2"].float().reshape(*lead, 1)
        return QuantizedTensor(
            "nvfp4",
            weight,
            tensors["weight_scale"],
            scale_2.expand(*lead, n).contiguous(),
            NVFP4_GROUP,
        )
    if scheme.algo == "FP8_BLOCK":
        bn, bk = scheme.block
        rows = tensors["weight_scale_inv"].float().repeat_interleave(bn, dim=-2)[..., :n, :]
        return QuantizedTensor("fp8", weight, rows.contiguous(), None, bk)
    scale = tensors["weight_scale"].float()
    rows = (
        scale.reshape(*lead, n, 1)
        if scale.shape[len(lead) :] == (n,) and n != 1
        else (scale.reshape(*lead, 1, 1).expand(*lead, n, 1))
    )
    return QuantizedTensor("fp8", weight, rows.contiguous(), None, k)


def matrix_bytes(scheme: LayerScheme, n: int, k: int) -> int:
    """Bytes one (n, k) matrix keeps in `scheme` (pool sizing from what the weights leave)."""
    if scheme.algo == "NVFP4":
        return n * k // 2 + n * k // NVFP4_GROUP + 4
    if scheme.algo == "FP8_BLOCK":
        return n * k + 4 * math.ceil(n / scheme.block[0]) * math.ceil(k / scheme.block[1])
    return n * k + 4
