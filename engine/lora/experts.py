"""Adapters on routed MoE experts (engine/layers/moe.py's `Experts`): each expert's stacked
projection gets a per-expert low-rank delta, each row of a batch its own slot's (or none).

PEFT adapts transformers 5's fused expert parameters (`experts.gate_up_proj` (E, 2I, D) or
`experts.up_proj` (E, I, D), and `experts.down_proj` (E, D, I)) through `target_parameters`;
engine/lora/expert_adapter.py reads its tensors into per-expert pairs A (E, r, in) and scaled
B (E, out, r). The slot table here is the projections' LoRALinear layout with the experts
inside each slot (r = max_lora_rank):

    a_rows: (S * E * r, in)   slot s, expert e: rows (s E + e) r ... (s E + e + 1) r
    b_rows: (S * E * r, out)  B transposed, scaled

so the fused MoE runs every (token, choice) pair as a row of the batched LoRA kernels with
"slot" s E + e (kernels/lora.py's ExpertDeltas): the same fixed shapes whatever the mix, which a
captured CPU step replays. TP: `Experts` keeps every expert with a slice of its intermediate;
B of the up projection loses the same rows, A of the down projection the same columns.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.lora.layer import active_rows
from baton.engine.parallel import ShardRule
from baton.engine.quantization.modules import stacked_weight
from baton.kernels.lora import ExpertDeltas

# baton's stacked parameter for each name transformers gives a routed experts' parameter
STACKED_NAMES = {"gate_up_proj": "up_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class ExpertLoRA(nn.Module):
    """One stacked projection's (`up_proj` or `down_proj`) part of the slot table."""

    def __init__(
        self,
        stack: torch.Tensor | nn.Module,
        max_loras: int,
        max_rank: int,
        name: str,
        *,
        swiglu: bool,
        reads_per_expert: bool,
    ):
        """swiglu: the experts' up stack is [gate | up]; reads_per_expert: transformers 4's
        per-expert adapter tensors apply to this model (engine/lora/expert_adapter.py)."""
        super().__init__()
        self.name = name  # the stacked parameter's in-memory name, `...experts.up_proj`
        self.swiglu, self.reads_per_expert = swiglu, reads_per_expert
        weight = stacked_weight(stack)  # a quantized stack's deltas run in float32
        self.num_experts, self.out_features, self.in_features = weight.shape
        self.rank = max_rank
        self.shard_rule: ShardRule | None = parallel.shard_rule(stack)
        plain = isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point
        dtype = weight.dtype if plain else torch.get_default_dtype()
        rows = max_loras * self.num_experts * max_rank
        self.register_buffer(
            "a_rows", torch.zeros(rows, self.in_features, dtype=dtype, device=weight.device), False
        )
        self.register_buffer(
            "b_rows", torch.zeros(rows, self.out_features, dtype=dtype, device=weight.device), False
        )

    @torch.no_grad()
    def write(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot `slot` := per-expert A (E, r', in) and scaled B (E, out, r'), or zeros."""
        width = self.num_experts * self.rank
        a = self.a_rows[slot * width : (slot + 1) * width].view(self.num_experts, self.rank, -1)
        b = self.b_rows[slot * width : (slot + 1) * width].view(self.num_experts, self.rank, -1)
        a.zero_()
        b.zero_()
        if pair is not None:
            r = pair[0].shape[1]
            a[:, :r].copy_(pair[0])
            b[:, :r].copy_(pair[1].transpose(1, 2))


class ExpertAdapters(nn.Module):
    """Set as `Experts.adapters`: the deltas its forward passes to fused_moe."""

    def __init__(self, up: ExpertLoRA, down: ExpertLoRA):
        super().__init__()
        self.up, self.down = up, down

    def deltas(self) -> ExpertDeltas | None:
        """This forward's deltas; None when no row has an adapter (the base experts only)."""
        rows = active_rows(self.up.name)
        if rows is None:
            return None
        up, down = self.up, self.down
        return ExpertDeltas(
            up_a=up.a_rows,
            up_b=up.b_rows,
            down_a=down.a_rows,
            down_b=down.b_rows,
            rank=up.rank,
            num_experts=up.num_experts,
            lora_slots=rows.lora_slots,
        )


def wrap_experts(
    backbone: nn.Module, max_loras: int, max_rank: int, prefix: str, reads_per_expert: bool
) -> dict:
    """Give every `Experts` under `backbone` its slot table; returns {in-memory stacked
    parameter name: its ExpertLoRA}."""
    wrapped: dict[str, ExpertLoRA] = {}
    for path, layer in list(backbone.named_modules()):
        if type(layer).__name__ != "Experts":
            continue
        up, down = (
            ExpertLoRA(
                getattr(layer, attr),
                max_loras,
                max_rank,
                f"{prefix}{path}.{attr}",
                swiglu=layer.activation == "swiglu",
                reads_per_expert=reads_per_expert,
            )
            for attr in ("up_proj", "down_proj")
        )
        layer.adapters = ExpertAdapters(up, down)
        wrapped[up.name], wrapped[down.name] = up, down
    return wrapped


def expert_elements(key: str, shape: list[int]) -> int:
    """A checkpoint tensor's share of the expert slot table, in elements per slot and rank row:
    (in + out) per expert, the input counted once for a SwiGLU expert's gate and up (they share
    it, one A of the fused gate_up). 0 for a tensor that is no routed expert's projection."""
    parts = key.split(".")
    if ".experts." not in key:
        return 0
    if len(shape) == 3 and parts[-1] in STACKED_NAMES:  # (E, out, in), stacked
        return shape[0] * (shape[1] + shape[2])
    if len(shape) == 2 and parts[-1] == "weight" and parts[-3].isdigit():  # experts.{e}.*
        name = parts[-2]
        if name in ("gate_proj", "w1"):
            return shape[0]  # its input is counted with up_proj's
        if name in ("up_proj", "w3", "down_proj", "w2"):
            return shape[0] + shape[1]
    return 0
