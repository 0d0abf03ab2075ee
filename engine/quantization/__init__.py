"""Quantized checkpoints (FP8, fine-grained FP8, NVFP4, ModelOpt mixed precision) and online FP8:
what the checkpoint says (config.py), what each scheme stores (schemes.py), what the checkpoint
stores for each weight, from its headers (stored.py), the modules that hold quantized weights
(modules.py) and the pass that puts them in a built model (transform.py).

The loader calls `read_quantization`, then `before_loading` and `after_loading` around its own
loading; nothing else in the engine knows a weight is quantized (but the GPU pool sizing, which asks
`weight_bytes` what the weights will take)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from baton.engine.checkpoint.weights import Rename
from baton.engine.quantization.config import QUANTIZATION_NAMES, QuantConfig, read_quantization
from baton.engine.quantization.stored import QUANTIZED_DTYPES, checkpoint_headers
from baton.engine.quantization.transform import (
    UNUSED_SUFFIXES,
    finalize,
    quantize_modules,
    quantize_online,
    skip_unused,
)

__all__ = [
    "QUANTIZATION_NAMES",
    "QuantConfig",
    "after_loading",
    "before_loading",
    "read_quantization",
    "weight_bytes",
]
# what online FP8 leaves in the serving dtype (its embeddings, norms, convolutions, lm_head)
UNQUANTIZED_ONLINE = ("embed", "norm", "conv1d", "lm_head", "A_log", "dt_bias", ".D")


def before_loading(
    model: nn.Module, model_dir: str | Path, quant: QuantConfig, rename: Rename, tp_size: int
) -> Rename:
    """Put quantized modules where the checkpoint stores quantized weights; returns the rename
    the loader uses (the scales read from the headers and not applied are skipped)."""
    if quant.online:
        return rename
    quantize_modules(model, quant, checkpoint_headers(model_dir, rename), tp_size)
    return skip_unused(rename)


def after_loading(model: nn.Module, quant: QuantConfig) -> None:
    if quant.online:
        quantize_online(model)
    else:
        finalize(model)


def weight_bytes(
    model_dir: str | Path,
    dtype: torch.dtype,
    quant: QuantConfig | None,
    rename: Rename,
    tp_size: int,
) -> int:
    """About the bytes one rank's weights take once loaded (the pools get what is left): stored
    quantized tensors as they are, online FP8's linears at a byte per weight, the rest in
    `dtype`; an even share of the whole at TP > 1. Headers only."""
    total = 0
    for name, header in checkpoint_headers(model_dir, rename).items():
        if name.endswith(UNUSED_SUFFIXES) or name.startswith("mtp."):
            continue
        numel = math.prod(header.shape)
        online_linear = (
            quant is not None
            and quant.online
            and len(header.shape) >= 2
            and not any(part in name for part in UNQUANTIZED_ONLINE)
        )
        if header.dtype in QUANTIZED_DTYPES or online_linear:
            total += numel
        elif quant is not None and name.rsplit(".", 1)[-1].startswith("weight_scale"):
            total += numel * 4
        else:
            total += numel * dtype.itemsize
    return total // tp_size
