"""Turn adapters on for a loaded model: wrap its adaptable projections and give it the slot
table (engine/lora/slots.py) that the scheduler fills and the forward reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from baton.engine.checkpoint.weights import checkpoint_files
from baton.engine.lora.expert_adapter import PER_EXPERT_ARCHITECTURES
from baton.engine.lora.experts import expert_elements, wrap_experts
from baton.engine.lora.layer import ADAPTABLE, wrap_adaptable
from baton.engine.lora.slots import AdapterTable


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRALimits:
    max_loras: int  # adapters in the slot table at once (one batch mixes at most this many)
    max_lora_rank: int  # every slot is this wide; a larger adapter is refused
    max_cpu_loras: int  # adapters kept read in host memory


def enable_adapters(
    model: nn.Module, limits: LoRALimits, rename: Callable[[str], str | None]
) -> AdapterTable:
    """Wrap `model.model` (the backbone; an MTP head drafts as the base) and attach the table
    as `model.adapters`. Call after the weights load, before the CPU packing."""
    targets = wrap_adaptable(model.model, limits.max_loras, limits.max_lora_rank, "model.")
    per_expert = model.config.architecture in PER_EXPERT_ARCHITECTURES
    targets |= wrap_experts(
        model.model, limits.max_loras, limits.max_lora_rank, "model.", per_expert
    )
    if not targets:
        raise ValueError(f"{type(model.model).__name__}: no projection baton can adapt")
    model.adapters = AdapterTable(
        targets,
        rename,
        max_loras=limits.max_loras,
        max_rank=limits.max_lora_rank,
        max_cpu_loras=limits.max_cpu_loras,
    )
    return model.adapters


def lora_limits(args) -> LoRALimits | None:
    """The limits EngineArgs ask for (None: LoRA off)."""
    if not args.enable_lora:
        return None
    return LoRALimits(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras,
    )


def check_adapter(name: str | None, adapters: AdapterTable | None) -> None:
    """Refuse a request for an adapter this engine does not serve (ValueError naming it)."""
    if name is None:
        return
    if adapters is None:
        raise ValueError(f"adapter {name!r} requested, but LoRA is not enabled (--enable-lora)")
    if not adapters.has(name):
        raise ValueError(
            f"adapter {name!r} is not loaded (loaded: {', '.join(adapters.names()) or 'none'})"
        )


def slot_table_bytes(model_dir, limits: LoRALimits | None, dtype: torch.dtype, tp_size: int) -> int:
    """About what the slot table's stacked A/B take on each rank (the pools' budget leaves it
    out): every adaptable projection's (in + out) * max_loras * max_lora_rank elements, and each
    routed expert's (engine/lora/experts.py), from the checkpoint's headers."""
    if limits is None:
        return 0
    names = {name for names in ADAPTABLE.values() for name in names}
    elements = 0
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():
                parts = key.split(".")
                if ".experts." in key:
                    elements += expert_elements(key, file.get_slice(key).get_shape())
                    continue
                if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in names:
                    continue
                shape = file.get_slice(key).get_shape()
                if len(shape) == 2:
                    elements += shape[0] + shape[1]
    per_rank = elements * limits.max_loras * limits.max_lora_rank // max(tp_size, 1)
    return per_rank * torch.finfo(dtype).bits // 8
