"""vLLM's LoRA flags, shared by `baton serve` and `baton up` (which gives them to both workers:
the prefill one computes prompts under the adapter, the decode one decodes under it)."""

from __future__ import annotations

import argparse


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters", "vLLM's flags (PEFT adapter directories)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="adapters served from the start, each by NAME as a request's `model`",
    )
    lora.add_argument("--max-loras", type=_count, help="adapters one batch may mix (default 1)")
    lora.add_argument("--max-lora-rank", type=_count, help="largest adapter rank (default 16)")
    lora.add_argument(
        "--max-cpu-loras",
        type=_count,
        help="adapters kept read in host memory (default: --max-loras)",
    )


def lora_flags(ns: argparse.Namespace) -> list[str]:
    """The LoRA flags `ns` holds, as `baton serve` arguments."""
    flags = ["--enable-lora"] if ns.enable_lora else []
    if ns.lora_modules:
        flags += ["--lora-modules", *ns.lora_modules]
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(ns, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(ns, name))]
    return flags
