"""The CPU backend step, applied once after loading to any model built from the shared layers
(never inside a family's forward):

1. layers that know a better CPU form repack themselves (`pack_for_cpu`: q/k/v fused into one
   prepacked matmul, relu fused into an up projection, gate/up fused, MoE experts reordered);
2. every remaining `nn.Linear` becomes a oneDNN-prepacked `PackedLinear` (kernels/linear.py):
   decode's few-row matmuls, lm_head above all, run 1.2-3x faster than F.linear;
   steps 1 and 2 pack each weight in the dtype `MatmulChooser` picks for its shape: a bf16 or
   fp16 model's matmuls run in float32 where this CPU's float32 GEMM is the faster one (timed
   here, once per shape and machine: kernels/matmul_choices.py keeps the choices on disk, so a
   later start times nothing; `BATON_CPU_MATMUL_DTYPE` forces `model` or `float32`); quantized
   linears repack for the weight-only kernel (kernels/cpu/quant.py) whatever the dtype;
3. layers that cache float32 forms of small parameters for the C kernels (`freeze`: the Mamba
   mixer's fused decode step, norms) take them now that the weights are final.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from baton.engine.quantization.modules import QuantizedLinear
from baton.kernels.linear import (
    MATMUL_DTYPE_ENV,
    TIMING_RULES,
    MatmulChooser,
    can_pack,
    matmul_dtypes,
    pack_linears,
)
from baton.kernels.matmul_choices import ChoiceCache

log = logging.getLogger(__name__)


def prepare_for_cpu(
    model: nn.Module, dtype: torch.dtype, chooser: MatmulChooser | None = None
) -> None:
    """Call after the weights are loaded and cast; the plain linear weights are dropped.
    chooser: the matmul dtype per shape (default: timed, or as `BATON_CPU_MATMUL_DTYPE` says)."""
    chooser = chooser or MatmulChooser(dtype, cache=ChoiceCache.for_this_machine(TIMING_RULES))
    with matmul_dtypes(chooser):
        if can_pack(dtype):
            for module in list(model.modules()):
                if hasattr(module, "pack_for_cpu"):
                    module.pack_for_cpu()
        pack_linears(model, dtype)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.pack_cpu()  # the weight-only kernel's panels (kernels/cpu/quant.py)
    log.info("CPU matmul dtype (%s=%s) %s", MATMUL_DTYPE_ENV, chooser.policy, chooser.summary())
    for module in model.modules():
        if hasattr(module, "freeze"):
            module.freeze()
