"""The adapted linear: a base projection plus the batched low-rank deltas of the adapters in the
slot table, each row applying its own slot's (or none).

    y = base(x) + ((x @ A.T) * rows) @ B          per token row t, with slot s = slot(t):
        A: (S * r, in)   the slots' A matrices stacked, each padded to r = max_lora_rank rows
        B: (S * r, out)  the slots' B matrices, transposed, scaled (lora_alpha / r) and stacked
        rows: (T, S * r) 1.0 on the r columns of the row's slot, 0.0 elsewhere (all 0: no adapter)

Every shape is fixed by the batch and the table, never by which slots the rows pick: the same
operators run whatever the mix, so a captured CPU step or CUDA graph replays any mix (the slot of
each row comes from the metadata's fixed buffers, ForwardBatch.lora_slots). The zero columns of
the rows a token does not use add exact zeros. The cost per token is S * r * (in + out) multiply-
adds beside the base's in * out: small at a few slots of rank 16 on real widths.

The wrapper is put around a layer's own nn.Linear (or QuantizedLinear) after the weights load and
before the CPU backend packs them (engine/layers/cpu_backend.py): fusing passes leave a wrapped
projection apart (`stored_as` is None for it) and the base inside is packed on its own. TP: the
wrapper keeps the base weight's shard rule, which slices B's rows (column-parallel) or A's
columns (row-parallel) exactly as the base weight was sliced (engine/lora/adapter.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.parallel import ShardRule
from baton.engine.quantization.modules import QuantizedLinear
from baton.kernels.lora import lora_expand, lora_kernel, lora_shrink

# layer class name -> the projections of it an adapter may target (called as modules in the
# layer's forward; a projection whose weight a fused kernel reads directly is not listed)
ADAPTABLE: dict[str, tuple[str, ...]] = {
    "Attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "QKNormAttention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "Mamba2Mixer": ("in_proj", "out_proj"),
    "Mamba1Mixer": ("in_proj", "x_proj", "dt_proj", "out_proj"),
    "GatedDeltaNet": (
        "in_proj_qkvz",
        "in_proj_ba",
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "q_proj",
        "k_proj",
        "v_proj",
        "g_proj",
        "b_proj",
        "a_proj",
        "out_proj",
        "o_proj",
    ),  # fmt: skip
    "ReluSquaredMLP": ("up_proj", "down_proj"),
    "GatedMLP": ("gate_proj", "up_proj", "down_proj"),
    "ShortConv": ("in_proj", "out_proj"),
}


class SlotRows:
    """The rows' slot selection of one forward: `columns(dtype)` is the (T, S * r) 0/1 matrix
    every adapted linear multiplies by, built once per forward and dtype."""

    def __init__(self, lora_slots: torch.Tensor, slot_of_column: torch.Tensor, active: bool):
        self.lora_slots = lora_slots  # (T,) int64, -1: no adapter
        self.slot_of_column = slot_of_column  # (S * r,) int64
        self.active = active  # host fact: some row has an adapter (else no delta is computed)
        self._columns: dict[torch.dtype, torch.Tensor] = {}

    def columns(self, dtype: torch.dtype, parts: int = 1) -> torch.Tensor:
        """(T, parts * S * r): the selection, repeated for a fused projection's parts."""
        if (dtype, parts) not in self._columns:
            if dtype not in self._columns:
                hit = self.lora_slots[:, None] == self.slot_of_column[None, :]
                self._columns[dtype] = hit.to(dtype)
            if parts > 1:
                self._columns[(dtype, parts)] = self._columns[dtype].repeat(1, parts)
        return self._columns[(dtype, parts) if parts > 1 else dtype]


_current: list[SlotRows] = []


@contextlib.contextmanager
def slot_rows(
    lora_slots: torch.Tensor, slot_of_column: torch.Tensor, active: bool
) -> Iterator[SlotRows]:
    """Scope one forward's row selection; adapted linears read it. Refuses nesting. `active`
    False (no row has an adapter, ForwardBatch.has_lora): the projections run their base only."""
    if _current:
        raise RuntimeError("an adapted forward is already running (slot_rows does not nest)")
    rows = SlotRows(lora_slots, slot_of_column, active)
    _current.append(rows)
    try:
        yield rows
    finally:
        _current.pop()


def active_rows(name: str) -> SlotRows | None:
    """This forward's row selection for the adapted module `name`; None when no row has an
    adapter. Refuses a call outside slot_rows."""
    if not _current:
        raise RuntimeError(f"{name}: an adapted module ran outside slot_rows")
    return _current[-1] if _current[-1].active else None


class LoRALinear(nn.Module):
    """`base(x)` plus the slot table's deltas (module docstring). `a_rows` and `b_rows` are this
    projection's part of the table, written by the slot table (engine/lora/slots.py)."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int, name: str):
        super().__init__()
        if not (type(base) is nn.Linear or isinstance(base, QuantizedLinear)):
            raise TypeError(f"{name}: an adapter wraps a linear layer, not {type(base).__name__}")
        self.name = name
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.rank = max_rank
        # relu stays outside the matmul (a ReLU² MLP then applies it after the delta)
        self.activation = "none"
        weight = base.weight
        self.shard_rule: ShardRule | None = parallel.shard_rule(weight)
        dtype, device = weight.dtype, weight.device
        if not dtype.is_floating_point:  # a quantized base (int8, fp8): the deltas run in float32
            dtype = torch.get_default_dtype()
        width = max_loras * max_rank
        self.register_buffer(
            "a_rows", torch.zeros(width, self.in_features, dtype=dtype, device=device), False
        )
        self.register_buffer(
            "b_rows", torch.zeros(width, self.out_features, dtype=dtype, device=device), False
        )

    @torch.no_grad()
    def write(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot `slot` := A (r', in) and scaled B (out, r') padded to the table's rank, or zeros."""
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        self.a_rows[rows].zero_()
        self.b_rows[rows].zero_()
        if pair is not None:
            r = pair[0].shape[0]
            self.a_rows[rows][:r].copy_(pair[0])
            self.b_rows[rows][:r].copy_(pair[1].t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not _current:
            raise RuntimeError(f"{self.name}: an adapted linear ran outside slot_rows")
        if not _current[-1].active:
            return y
        inputs = x.reshape(-1, self.in_features)
        if y.is_contiguous() and lora_kernel(inputs, self.a_rows, y) is not None:
            slots = _current[-1].lora_slots  # each row its own slot only
            low = lora_shrink(inputs, self.a_rows, slots, self.rank, 1)
            lora_expand(low, self.b_rows, slots, self.rank, y.view(-1, self.out_features))
            return y
        columns = _current[-1].columns(self.a_rows.dtype)
        inputs = x if x.dtype == self.a_rows.dtype else x.to(self.a_rows.dtype)
        low = torch.mm(inputs.reshape(-1, self.in_features), self.a_rows.t()).mul_(columns)
        if y.dtype == low.dtype and y.is_contiguous():
            y.view(-1, self.out_features).addmm_(low, self.b_rows)  # the delta added in place
            return y
        return y.add_(torch.mm(low, self.b_rows).view(y.shape).to(y.dtype))


class FusedLoRALinear(nn.Module):
    """Adapted projections fused for the CPU (q|k|v, gate|up, GDN's projections): one packed base
    matmul, one matmul through every part's A (the parts' a_rows become views of one stacked
    tensor, so the slot table still writes each part where it always did), and each part's B
    added into its columns of the output."""

    def __init__(self, base: nn.Module, parts: list[LoRALinear]):
        super().__init__()
        self.base = base
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.activation = "none"
        self.rank = parts[0].rank
        self.width = parts[0].a_rows.shape[0]
        self.register_buffer("a_rows", torch.cat([p.a_rows for p in parts]), False)
        offsets = [0]
        for i, part in enumerate(parts):
            part.a_rows = self.a_rows[i * self.width : (i + 1) * self.width]
            part.base = None  # its weight lives in the fused base now
            offsets.append(offsets[-1] + part.out_features)
        self.offsets = offsets
        self.parts = list(parts)  # not submodules: their buffers are views or read from here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not _current:
            raise RuntimeError("an adapted linear ran outside slot_rows")
        if not _current[-1].active:
            return y
        rows = y.view(-1, self.out_features)
        inputs = x.reshape(-1, self.in_features)
        if lora_kernel(inputs, self.a_rows, rows) is not None:  # each row its own slot only
            slots, r = _current[-1].lora_slots, self.rank
            low = lora_shrink(inputs, self.a_rows, slots, r, len(self.parts))
            for i, part in enumerate(self.parts):
                out = rows[:, self.offsets[i] : self.offsets[i + 1]]
                lora_expand(low[:, i * r : (i + 1) * r], part.b_rows, slots, r, out)
            return y
        dtype = self.a_rows.dtype
        columns = _current[-1].columns(dtype, len(self.parts))
        inputs = inputs if inputs.dtype == dtype else inputs.to(dtype)
        low = torch.mm(inputs, self.a_rows.t()).mul_(columns)
        for i, part in enumerate(self.parts):
            out = rows[:, self.offsets[i] : self.offsets[i + 1]]
            part_low = low[:, i * self.width : (i + 1) * self.width]
            if out.dtype == dtype:
                out.addmm_(part_low, part.b_rows)
            else:
                out.add_(torch.mm(part_low, part.b_rows).to(out.dtype))
        return y


def wrap_adaptable(backbone: nn.Module, max_loras: int, max_rank: int, prefix: str) -> dict:
    """Wrap every adaptable projection under `backbone` (named from the model root with
    `prefix`); returns {in-memory module name: its LoRALinear}."""
    wrapped: dict[str, LoRALinear] = {}
    for path, layer in list(backbone.named_modules()):
        for attr in ADAPTABLE.get(type(layer).__name__, ()):
            base = getattr(layer, attr, None)
            if base is None:
                continue
            name = f"{prefix}{path}.{attr}" if path else f"{prefix}{attr}"
            module = LoRALinear(base, max_loras, max_rank, name)
            setattr(layer, attr, module)
            wrapped[name] = module
    return wrapped
