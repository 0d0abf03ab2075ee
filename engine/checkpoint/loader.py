"""Build a model from an HF directory: config, module on the target device, weights."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from baton.engine import parallel
from baton.engine.checkpoint.weights import load_into, tensor_names
from baton.engine.config import DTYPE_ALIASES, DTYPE_NAMES, SERVING_DTYPES, ModelConfig
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.cpu_backend import prepare_for_cpu
from baton.engine.lora.model import LoRALimits, enable_adapters
from baton.engine.models.registry import family_named
from baton.engine.parallel import TensorParallel
from baton.engine.parallel.support import check_tp_supported
from baton.engine.quantization import after_loading, before_loading, read_quantization

log = logging.getLogger("baton.engine")

DTYPES = {name: getattr(torch, name) for name in SERVING_DTYPES}


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
    *,
    with_mtp: bool = False,
    quantization: str | None = None,
    lora: LoRALimits | None = None,
) -> CausalLM:
    """tp: this rank's place; every layer is built with, and loads, its shard only. with_mtp:
    build and load the checkpoint's MTP head (speculative decoding drafts with it).
    quantization: vLLM's `--quantization` (None: as the checkpoint is stored; "fp8" on an
    unquantized checkpoint quantizes it at load). lora: wrap the backbone's adaptable
    projections for adapters within these limits (engine/lora/), before the CPU packing."""
    config = ModelConfig.from_hf(model_dir).with_mtp(with_mtp)
    check_tp_supported(config, tp.size)
    family = family_named(config.architecture)
    rename = family.checkpoint_renamer(config)
    quant = read_quantization(model_dir, quantization, rename)
    if (
        family.untie_with_stored_lm_head
        and config.tie_word_embeddings
        and "lm_head.weight" in tensor_names(model_dir, rename)
    ):
        config = dataclasses.replace(config, tie_word_embeddings=False)
    began = time.perf_counter()
    with torch.device(device), parallel.building(tp), _NoRandomInit():
        model = family.model_class(config)
    built = time.perf_counter()
    if quant is not None:
        rename = before_loading(model, model_dir, quant, rename, tp.size)
    load_into(model, model_dir, rename)
    if quant is not None:
        after_loading(model, quant)
    loaded = time.perf_counter()
    # Mamba parameters A_log, D, dt_bias and norms stay where they are read in float32 anyway;
    # cast the whole module once so matmuls run in the serving dtype.
    cast_model(model, dtype)
    model.eval().requires_grad_(False)
    if lora is not None:
        enable_adapters(model, lora, family.checkpoint_renamer(config))
    if torch.device(device).type == "cpu":
        with _NoRandomInit():  # layers that fuse linears build new ones, filled from the old
            prepare_for_cpu(model, dtype)
    log.info(
        "model built in %.2f s, weights read in %.2f s, prepared in %.2f s: %.0f MiB held",
        built - began,
        loaded - built,
        time.perf_counter() - loaded,
        held_bytes(model) / 2**20,
    )
    return model


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds, each storage once: parameters, buffers, and the
    tensors modules keep as attributes (packed weights, float32 forms for C kernels)."""
    storages: dict[int, int] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            try:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except NotImplementedError:  # oneDNN's packed weights are opaque: their elements
                storages[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(storages.values())


# torch.nn.init's random fills, and the tensor methods they end in
_RANDOM_FILLS = frozenset(
    {
        torch.nn.init.uniform_,
        torch.nn.init.normal_,
        torch.nn.init.trunc_normal_,
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.kaiming_normal_,
        torch.nn.init.xavier_uniform_,
        torch.nn.init.xavier_normal_,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
    }
)


class _NoRandomInit(TorchFunctionMode):
    """While a model is built (and while its layers fuse linears for the CPU), the random fills
    of layer constructors (nn.Linear's kaiming_uniform_, nn.Embedding's normal_) leave the new
    tensors as allocated: load_into overwrites every parameter (a parameter the checkpoint lacks
    is an error), fusing copies the parts in, and the fills took ~1 s of a 110M model's start
    on 2 cores (a minute at 9B). Deterministic fills (ones, zeros, arange) run: they may build
    what no checkpoint holds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)`, except modules marked `keep_float32` (the MoE router: a bf16 gate
    flips near-equal top-k choices, so transformers keeps it in float32 too)."""
    for module in model.modules():
        if getattr(module, "keep_float32", False):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
