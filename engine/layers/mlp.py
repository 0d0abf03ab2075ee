"""Dense MLPs: relu² up/down (NemotronH's `mlp` block and its MoE's shared expert) and gated
down(act(gate) * up) with SiLU (SwiGLU: Bamba, Falcon-H1) or GELU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine import parallel
from baton.engine.lora.layer import FusedLoRALinear, LoRALinear
from baton.engine.quantization.modules import QuantizedLinear
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.linear import PackedLinear


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))²): NemotronH's `mlp` block and its MoE's shared expert.

    Under tensor parallelism up_proj is column-parallel and down_proj row-parallel: each rank
    holds a slice of the intermediate and the partial outputs are all-reduced, here or, with
    reduce_output=False, by the owner (the MoE sums its parts first: one all-reduce)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        reduce_output: bool = True,
        what: str = "intermediate_size",
    ):
        super().__init__()
        self.tp = tp = parallel.current()
        self.reduce_output = reduce_output
        first, intermediate_size = parallel.split_evenly(intermediate_size, tp, what)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        if tp.size > 1:
            part = ((first, intermediate_size),)
            parallel.shard(self.up_proj.weight, parallel.Slices(dim=0, ranges=part))
            parallel.shard(self.up_proj.bias, parallel.Slices(dim=0, ranges=part))
            parallel.shard(self.down_proj.weight, parallel.Slices(dim=1, ranges=part))
            parallel.shard(self.down_proj.bias, parallel.FirstRankOnly(rank=tp.rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        if getattr(self.up_proj, "activation", "none") != "relu":
            up = torch.relu_(up)
        # In place: `up` is this call's own tensor, and a prefill's (tokens, intermediate) square
        # would be a second multi-MB allocation per layer.
        out = self.down_proj(up.square_())
        return self.tp.all_reduce(out) if self.reduce_output else out

    def pack_for_cpu(self) -> None:
        """relu fused into the up projection's packed matmul (kernels/linear.py, or the
        quantized kernel's)."""
        if isinstance(self.up_proj, QuantizedLinear):
            self.up_proj.pack_cpu(relu=True)
        elif type(self.up_proj) is nn.Linear:
            self.up_proj = PackedLinear(self.up_proj, activation="relu")
        # else an adapted projection (engine/lora/layer.py): its base is packed on its own and
        # relu follows the adapter's delta


# transformers' ACT2FN for these names ("gelu_pytorch_tanh": Gemma's, GELU's tanh approximation)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def gated_activation(
    gate_up: torch.Tensor, activation: str, gate_multiplier: float = 1.0
) -> torch.Tensor:
    """act(gate * gate_multiplier) * up for gate_up = [gate | up] on its last dim; SiLU on the
    CPU in one pass (kernels/cpu/ops.c, rounded op by op like this expression in torch)."""
    if activation == "silu" and cpu_ops.silu_mul_supported(gate_up):
        return cpu_ops.silu_mul_cpu(gate_up, gate_multiplier)
    return _gated_torch(*gate_up.chunk(2, dim=-1), activation, gate_multiplier)


def _gated_torch(
    gate: torch.Tensor, up: torch.Tensor, activation: str, gate_multiplier: float
) -> torch.Tensor:
    if gate_multiplier != 1.0:
        gate = gate * gate_multiplier
    return up * ACTIVATIONS[activation](gate)


# Rows a CPU prefill runs through a gated MLP at a time. The whole step's [gate | up] at once
# is (tokens, 2 x intermediate): 32 MiB at 2048 tokens of a 4096-wide gate_up, the size from
# which glibc maps every allocation afresh, so each layer's GEMM paid for page faults on its
# output (~20% of its time) and the activation then re-read it from memory. 256 rows keep the
# intermediate (4 MiB there) in the caches between the three calls. Each output row depends on
# its own input row only (baton's GEMM gives the same bits at any row count; measured on the
# 2-core VM: 0.92x the MLP's time at 2048 rows, one thread).
CPU_ROW_CHUNK = 256


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier (the
    multipliers are Falcon-H1's `mlp_multipliers`, 1.0 elsewhere).

    Under tensor parallelism gate_proj and up_proj are column-parallel and down_proj
    row-parallel, like ReluSquaredMLP (reduce_output=False: the owner all-reduces)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        activation: str,
        multipliers: tuple[float, float] = (1.0, 1.0),
        reduce_output: bool = True,
        what: str = "intermediate_size",
    ):
        super().__init__()
        self.gate_multiplier, self.down_multiplier = multipliers
        if activation not in ACTIVATIONS:
            raise ValueError(f"gated MLP activation must be one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.tp = tp = parallel.current()
        self.reduce_output = reduce_output
        first, intermediate_size = parallel.split_evenly(intermediate_size, tp, what)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        if tp.size > 1:
            part = parallel.Slices(dim=0, ranges=((first, intermediate_size),))
            for proj in (self.gate_proj, self.up_proj):
                parallel.shard(proj.weight, part)
                parallel.shard(proj.bias, part)
            parallel.shard(self.down_proj.weight, parallel.Slices(dim=1, ranges=part.ranges))
            parallel.shard(self.down_proj.bias, parallel.FirstRankOnly(rank=tp.rank))
        self.gate_up: nn.Module | None = None  # CPU: gate and up in one packed matmul
        self.by_rows = False  # CPU: a prefill's rows run CPU_ROW_CHUNK at a time (forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.by_rows and x.dim() == 2 and len(x) > CPU_ROW_CHUNK:
            out = x.new_empty(len(x), self.down_proj.out_features)
            for first in range(0, len(x), CPU_ROW_CHUNK):
                rows = slice(first, first + CPU_ROW_CHUNK)
                out[rows] = self._unreduced(x[rows])
        else:
            out = self._unreduced(x)
        return self.tp.all_reduce(out) if self.reduce_output else out

    def _unreduced(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            hidden = gated_activation(self.gate_up(x), self.activation, self.gate_multiplier)
        else:
            hidden = _gated_torch(
                self.gate_proj(x), self.up_proj(x), self.activation, self.gate_multiplier
            )
        out = self.down_proj(hidden)
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier

    def pack_for_cpu(self) -> None:
        """One packed matmul for gate and up (the two plain projections are dropped), unless
        they are stored differently (mixed precision)."""
        self.gate_up = fuse_for_cpu([self.gate_proj, self.up_proj])
        if self.gate_up is not None:
            del self.gate_proj, self.up_proj
        # An adapted projection reads each row's adapter from the step's rows (engine/lora):
        # its rows must stay whole.
        self.by_rows = not any(
            isinstance(m, (LoRALinear, FusedLoRALinear)) for m in (self.gate_up, self.down_proj)
        )


class FusedGatedMLP(nn.Module):
    """down(act(gate) * up) with gate and up stored as one matrix, gate rows first (Granite's
    `shared_mlp.input_linear` / `output_linear`, Zamba2's `gate_up_proj` / `down_proj`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        activation: str,
        names: tuple[str, str],
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"gated MLP activation must be one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.names = names
        self.add_module(names[0], nn.Linear(hidden_size, 2 * intermediate_size, bias=bias))
        self.add_module(names[1], nn.Linear(intermediate_size, hidden_size, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = gated_activation(getattr(self, self.names[0])(x), self.activation)
        return getattr(self, self.names[1])(hidden)


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the parts' outputs side by side."""
    first = parts[0]
    fused = nn.Linear(
        first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None
    )
    fused = fused.to(device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


def stored_as(linear: nn.Module) -> tuple[str, int] | None:
    """What must match for linears to fuse on the CPU: ("plain", 0) for an nn.Linear, (format,
    scale group) for a loaded QuantizedLinear, an adapted projection's base's marked as adapted
    (engine/lora/layer.py), None for anything else (never fused)."""
    if isinstance(linear, LoRALinear):
        kind = stored_as(linear.base)
        return None if kind is None else ("adapted " + kind[0], kind[1])
    if type(linear) is nn.Linear:
        return ("plain", 0)
    if isinstance(linear, QuantizedLinear) and linear.quantized is not None:
        return (linear.quantized.format, linear.quantized.group)
    return None


def fuse_for_cpu(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing the parts' outputs side by side, packed for the CPU: a PackedLinear
    over plain linears, a QuantizedLinear over parts quantized alike (each part's rows keep
    their own scales); None when the parts are stored differently (mixed precision: each is
    then packed on its own)."""
    kinds = {stored_as(p) for p in parts}
    if len(kinds) != 1 or None in kinds:
        return None
    if isinstance(parts[0], LoRALinear):  # the bases fused, each part's delta kept apart
        base = fuse_for_cpu([p.base for p in parts])
        return None if base is None else FusedLoRALinear(base, parts)
    if kinds == {("plain", 0)}:
        return PackedLinear(fuse_linears(parts))
    fused = QuantizedLinear.fuse(parts)
    fused.pack_cpu()
    return fused
