"""The modules that hold quantized weights: `QuantizedWeight` (a weight as the checkpoint stores
it, named as stored, then the kernels' per-row `QuantizedTensor`) for a MoE's expert stacks, and
`QuantizedLinear` (the same with a bias and a forward) in place of an `nn.Linear`.

Life of one: built by engine/quantization/transform.py in place of the unquantized weight, with
this rank's shapes and slice rules (schemes.py); filled by the loader, each tensor checked as it
loads; `finalize()` after loading turns the stored tensors into the per-row form the kernels
take; on the CPU, `pack_cpu()` repacks that into the weight-only kernel's panels and keeps only
those (codes and scales stay quantized: no dequantized copy exists).

An expert stack whose checkpoint stores each expert's rows in parts (Qwen3.5-MoE's quantized
releases: `experts.{e}.gate_proj` and `experts.{e}.up_proj` for the [gate | up] rows) is held as
one QuantizedWeight per part, each under its part's name beside the stack (so the loader's
per-expert names find them), each knowing the stack it is `part_of`; after loading the parts
are joined row-wise into one weight under the stack's name (transform.finalize).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine import parallel
from baton.engine.quantization.config import LayerScheme
from baton.engine.quantization.schemes import (
    WeightShape,
    check_values,
    quantized_tensor,
    scale_rule,
    tensor_specs,
)
from baton.kernels.cpu import quant as cpu_quant
from baton.kernels.quant import QuantizedTensor, concat_rows, dequantize, quant_linear


@dataclass(frozen=True, kw_only=True, slots=True)
class StackPart:
    """A part of an expert stack stored in parts: the stack's attribute and its parts' attributes
    (siblings under the same parent), in row order."""

    stack: str
    parts: tuple[str, ...]


class QuantizedWeight(nn.Module):
    """One quantized weight of shape (*lead, N, K); lead: the experts of a stack."""

    keep_float32 = True  # the loader's cast leaves codes and scales as they are

    def __init__(
        self,
        *,
        name: str,
        scheme: LayerScheme,
        shape: WeightShape,
        lead: tuple[int, ...],
        scale_shape: tuple[int, ...] | None,
        size_word: str,
        device: torch.device,
        part_of: StackPart | None,
    ):
        """name: the model's name of the module (errors); scale_shape: the checkpoint's per-matrix
        FP8 weight_scale shape; size_word: what slices it ("tensor-parallel size 2"); part_of:
        the stack this weight is a part of (None: a whole weight)."""
        super().__init__()
        self.scheme, self.part_of = scheme, part_of
        self.local = shape.local
        self.specs = tensor_specs(scheme, shape, scale_shape)
        for spec in self.specs:
            param = nn.Parameter(
                torch.zeros((*lead, *spec.local_shape), dtype=spec.param_dtype, device=device),
                requires_grad=False,
            )
            rule = scale_rule(spec, shape, scheme, name, size_word)
            if rule is not None:
                parallel.shard(param, rule)
            param.check_checkpoint = functools.partial(check_values, spec=spec, key=scheme.key)
            self.register_parameter(spec.suffix, param)
        self.quantized: QuantizedTensor | None = None

    @classmethod
    def of(cls, quantized: QuantizedTensor) -> QuantizedWeight:
        """A weight already in per-row form (online quantization, fused parts)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.scheme, module.specs, module.part_of = None, [], None
        module.local = tuple(quantized.shape[-2:])
        module.quantized = quantized
        return module

    def finalize(self) -> None:
        """The loaded tensors -> the per-row QuantizedTensor; the stored forms are dropped."""
        tensors = {spec.suffix: getattr(self, spec.suffix).data for spec in self.specs}
        self.quantized = quantized_tensor(self.scheme, tensors, self.local)
        for spec in self.specs:
            delattr(self, spec.suffix)
        self.specs = []

    def extra_repr(self) -> str:
        q = self.quantized
        what = self.scheme.algo if self.scheme is not None else q.format if q else "?"
        return f"{what}, shape={q.shape if q is not None else self.local}"


class QuantizedLinear(QuantizedWeight):
    """`y = x @ W.T + b` over a quantized W, in x's dtype (weight-only on the CPU: the checkpoint's
    input_scale is not applied). The bias stays float32."""

    def __init__(self, linear: nn.Linear, **kwargs):
        super().__init__(lead=(), part_of=None, **kwargs)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # keeps its slice rule (a row-parallel bias: rank 0 only)
        self.packed: cpu_quant.PackedQuant | None = None
        self.relu = False

    @classmethod
    def of_parts(cls, quantized: QuantizedTensor, bias: torch.Tensor | None) -> QuantizedLinear:
        module = cls.of(quantized)
        module.out_features, module.in_features = quantized.shape
        module.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        module.packed, module.relu = None, False
        return module

    @classmethod
    def fuse(cls, parts: list[QuantizedLinear]) -> QuantizedLinear:
        """One linear whose outputs are the parts' side by side, each part's rows keeping their
        own scales (q | k | v with three per-tensor scales)."""
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b.float() for b in biases])
        return cls.of_parts(concat_rows([p.quantized for p in parts]), bias)

    def pack_cpu(self, relu: bool = False) -> None:
        """Repack for the CPU kernel (once; `relu` fused into it), keeping only the panels."""
        if self.packed is None and cpu_quant.supported():
            self.packed = cpu_quant.pack(self.quantized)
            self.quantized = None
            if self.bias is not None:
                self.bias = nn.Parameter(
                    self.bias.detach().float().contiguous(), requires_grad=False
                )
        if self.packed is not None:
            self.relu = self.relu or relu

    @property
    def format(self) -> str:
        """The weights' format ("fp8", "nvfp4"), packed for the CPU kernel or not (where that
        kernel does not run, the torch path reads the quantized tensor)."""
        return self.packed.format if self.packed is not None else self.quantized.format

    @property
    def activation(self) -> str:
        """ "relu" when the relu is fused (ReluSquaredMLP then does not apply it again)."""
        return "relu" if self.relu else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_quant.linear(x, self.packed, self.bias, self.relu)
        out = quant_linear(x, self.quantized, self.bias)
        return F.relu(out) if self.relu else out

    def extra_repr(self) -> str:
        packed = self.packed
        if packed is not None:
            return (
                f"{packed.format} packed for the CPU, ({packed.out_features}, {packed.in_features})"
            )
        return super().extra_repr()


class ReadWeight(QuantizedWeight):
    """A quantized weight its layer reads rather than calls (MLA's kv_b_proj: the absorbed
    attention reads its W_UK and W_UV halves): loaded as the checkpoint stores it, then
    dequantized once (`as_float`) into a plain `weight`, as SGLang does for kv_b_proj."""

    def __init__(self, **kwargs):
        super().__init__(lead=(), part_of=None, **kwargs)

    def as_float(self) -> nn.Module:
        holder = nn.Module()
        holder.weight = nn.Parameter(dequantize(self.quantized, torch.float32), requires_grad=False)
        return holder


def stacked_weight(value: torch.Tensor | nn.Module) -> torch.Tensor | QuantizedTensor:
    """An expert stack's weights for kernels/moe.py: a plain tensor (or a module holding it as
    `weight`), or the QuantizedTensor of a quantized one."""
    if isinstance(value, QuantizedWeight):
        return value.quantized
    if isinstance(value, nn.Module):
        return value.weight
    return value
