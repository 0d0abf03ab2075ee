"""Turn adapters on for a loaded model: wrap its adaptable projections and give it the slot
table (engine/lora/slots.py) that the scheduler fills and the forward reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from baton.engine.lora.layer import wrap_adaptable
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
