"""Quantized checkpoints (FP8, fine-grained FP8, NVFP4, ModelOpt mixed precision) and online FP8:
what the checkpoint says (config.py), what each scheme stores (schemes.py), the modules that hold
quantized weights (modules.py) and the pass that puts them in a built model (transform.py).

The loader calls `read_quantization`, then `before_loading` and `after_loading` around its own
loading; nothing else in the engine knows a weight is quantized."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from engine.checkpoint.weights import Rename
from engine.quantization.config import QUANTIZATION_NAMES, QuantConfig, read_quantization
from engine.quantization.transform import (
    checkpoint_headers,
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
]


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
