"""Build a model from an HF directory: config, module on the target device, weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.models.nemotron_h import NemotronHForCausalLM
from engine.weights import load_into, tensor_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = config.torch_dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str
) -> NemotronHForCausalLM:
    config = ModelConfig.from_hf(model_dir)
    if config.tie_word_embeddings and "lm_head.weight" in tensor_names(model_dir):
        # transformers' NemotronH never ties lm_head to the embeddings (no tied-weight keys), so
        # a checkpoint that carries its own lm_head uses it whatever the config says.
        config = dataclasses.replace(config, tie_word_embeddings=False)
    with torch.device(device):
        model = NemotronHForCausalLM(config)
    load_into(model, model_dir)
    # Mamba parameters A_log, D, dt_bias and norms stay where they are read in float32 anyway;
    # cast the whole module once so matmuls run in the serving dtype.
    cast_model(model, dtype)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        model.prepare_for_cpu(dtype)
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
