"""Build a model from an HF directory: config, module on the target device, weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine import parallel
from engine.checkpoint.weights import load_into, tensor_names
from engine.config import ModelConfig
from engine.layers.causal_lm import CausalLM
from engine.layers.cpu_backend import prepare_for_cpu
from engine.models.registry import family_named
from engine.parallel import TensorParallel
from engine.parallel.support import check_tp_supported
from engine.quantization import after_loading, before_loading, read_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings
# What --dtype accepts: auto is the checkpoint's own dtype (config.json), as in vLLM.
DTYPE_NAMES = ("auto", *DTYPES, *DTYPE_ALIASES)


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = config.torch_dtype
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel = parallel.SINGLE,
    quantization: str | None = None,
) -> CausalLM:
    """tp: this rank's place; every layer is built with, and loads, its shard only.
    quantization: vLLM's `--quantization` (None: as the checkpoint is stored; "fp8" on an
    unquantized checkpoint quantizes it at load)."""
    config = ModelConfig.from_hf(model_dir)
    check_tp_supported(config, tp.size)
    family = family_named(config.architecture)
    quant = read_quantization(model_dir, quantization, family.checkpoint_name)
    if (
        family.untie_with_stored_lm_head
        and config.tie_word_embeddings
        and "lm_head.weight" in tensor_names(model_dir, family.checkpoint_name)
    ):
        config = dataclasses.replace(config, tie_word_embeddings=False)
    with torch.device(device), parallel.building(tp):
        model = family.model_class(config)
    rename = family.checkpoint_name
    if quant is not None:
        rename = before_loading(model, model_dir, quant, rename, tp.size)
    load_into(model, model_dir, rename)
    if quant is not None:
        after_loading(model, quant)
    # Mamba parameters A_log, D, dt_bias and norms stay where they are read in float32 anyway;
    # cast the whole module once so matmuls run in the serving dtype.
    cast_model(model, dtype)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        prepare_for_cpu(model, dtype)
    return model


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)`, except modules marked `keep_float32` (the MoE router: a bf16 gate
    flips near-equal top-k choices, so transformers keeps it in float32 too)."""
    for module in model.modules():
        if getattr(module, "keep_float32", False):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
