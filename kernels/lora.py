"""Batched LoRA deltas (punica's shrink/expand, "bgmv"): each row of a batch applies only its own
slot's adapter, or none.

    for every row t with slot s = lora_slots[t] >= 0:
        low[t, p r : (p + 1) r] = x[t] @ A[p S r + s r : p S r + (s + 1) r].T     (shrink, per part p)
        out[t] += low[t, p r : (p + 1) r] @ B_p[s r : (s + 1) r]                   (expand)
    rows with s = -1 are left untouched (low is 0 there)

Shapes and dtypes (the slot table's layout, engine/lora/slots.py; r = max_lora_rank):
    x:          (T, in)              float32 / bfloat16 / float16
    a_rows:     (parts * S * r, in)  the table's dtype; a fused projection's parts stacked
    b_rows:     (S * r, n)           one part's B, transposed and pre-scaled
    lora_slots: (T,) int64           -1: no adapter
    low:        (T, parts * r)       float32
    out:        (T, n)               updated in place (a column range of a wider output is fine)

Three forms of the same operation: the C kernels (kernels/cpu/lora.c, through
kernels/cpu/lora.py) on CPU tensors, the Triton kernels (kernels/triton/lora.py) under the Triton
backend, and the torch path below (a per-row gather of the slot's matrices + bmm), which is the
readable reference. Unlike the dense selection of engine/lora/layer.py, the work is r (in + n)
per row, whatever the number of slots. Shapes never depend on which slots the rows pick, so a
captured CPU step or CUDA graph replays any mix.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from baton.kernels.backend import select_backend

Kernel = Literal["cpu", "triton"]


def lora_kernel(x: torch.Tensor, a_rows: torch.Tensor, out: torch.Tensor) -> Kernel | None:
    """Which batched kernel serves these tensors: "triton" under the Triton backend, "cpu" for
    CPU tensors of float32 / bfloat16 with the C library built, None otherwise (the caller runs
    a torch path)."""
    if select_backend(x) == "triton":
        return "triton"
    from baton.kernels.cpu import lora as cpu_lora

    return "cpu" if cpu_lora.supported(x, a_rows, out) else None


def lora_shrink(
    x: torch.Tensor, a_rows: torch.Tensor, lora_slots: torch.Tensor, rank: int, parts: int
) -> torch.Tensor:
    """low (T, parts * rank) float32: x through each row's own slot's A of every part."""
    kernel = lora_kernel(x, a_rows, x)
    if kernel == "triton":
        from baton.kernels.triton.lora import lora_shrink_triton

        return lora_shrink_triton(x, a_rows, lora_slots, rank, parts)
    if kernel == "cpu":
        from baton.kernels.cpu.lora import lora_shrink_cpu

        return lora_shrink_cpu(x, a_rows, lora_slots, rank, parts)
    return lora_shrink_torch(x, a_rows, lora_slots, rank, parts)


def lora_expand(
    low: torch.Tensor, b_rows: torch.Tensor, lora_slots: torch.Tensor, rank: int, out: torch.Tensor
) -> None:
    """out (T, n) += low (T, rank) @ each row's own slot's B; rows with slot -1 untouched."""
    kernel = lora_kernel(out, b_rows, out)
    if kernel == "triton":
        from baton.kernels.triton.lora import lora_expand_triton

        lora_expand_triton(low, b_rows, lora_slots, rank, out)
    elif kernel == "cpu":
        from baton.kernels.cpu.lora import lora_expand_cpu

        lora_expand_cpu(low, b_rows, lora_slots, rank, out)
    else:
        lora_expand_torch(low, b_rows, lora_slots, rank, out)


def lora_delta(
    x: torch.Tensor,
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    lora_slots: torch.Tensor,
    rank: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """out (T, n) += each row's own adapter's x @ A.T @ B, in place; returns out."""
    lora_expand(lora_shrink(x, a_rows, lora_slots, rank, 1), b_rows, lora_slots, rank, out)
    return out


class ExpertDeltas(NamedTuple):
    """One MoE layer's routed-expert adapters for one forward (engine/lora/experts.py). The slot
    table is slot-major, then expert: the r rows of slot s, expert e start at row (s E + e) r,
    so a (token, choice) pair is a row of the kernels above with "slot" s E + e.

        up_a:   (S * E * r, D)        up_b:   (S * E * r, up_rows)   (gate | up for SwiGLU)
        down_a: (S * E * r, I)        down_b: (S * E * r, D)         B transposed and scaled
        lora_slots: (T,) int64, -1: the token has no adapter
    """

    up_a: torch.Tensor
    up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    rank: int
    num_experts: int
    lora_slots: torch.Tensor

    def pair_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """(T * k,) int64: each (token, choice) pair's row group s E + e, or -1 (fixed shapes)."""
        slots = self.lora_slots[:, None]
        return torch.where(slots >= 0, slots * self.num_experts + ids, -1).flatten()

    def up_delta(self, x: torch.Tensor, pair_slots: torch.Tensor, k: int) -> torch.Tensor:
        """(T * k, up_rows) float32: each pair's B_e A_e x of its token, 0 for pairs without."""
        rows = x[:, None, :].expand(-1, k, -1).reshape(-1, x.shape[1])
        out = torch.zeros(rows.shape[0], self.up_b.shape[1], dtype=torch.float32, device=x.device)
        return lora_delta(rows, self.up_a, self.up_b, pair_slots, self.rank, out)

    def down_delta(self, h: torch.Tensor, pair_slots: torch.Tensor, out: torch.Tensor) -> None:
        """out (n, D) += each pair's B_e A_e h of the activated expert rows h (n, I)."""
        lora_delta(h, self.down_a, self.down_b, pair_slots, self.rank, out)


# -- torch path -------------------------------------------------------------------------------


def _own_slot(lora_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, has): the slot each row reads (-1 clamped to 0) and (T, 1) 1.0 / 0.0 for whether
    the row has an adapter at all (fixed shapes: no boolean indexing)."""
    return lora_slots.clamp(min=0), (lora_slots >= 0).to(torch.float32)[:, None]


def lora_shrink_torch(
    x: torch.Tensor, a_rows: torch.Tensor, lora_slots: torch.Tensor, rank: int, parts: int
) -> torch.Tensor:
    T, width = x.shape[0], a_rows.shape[1]
    index, has = _own_slot(lora_slots)
    by_slot = a_rows.view(parts, -1, rank, width)  # (parts, S, r, in)
    own = by_slot[:, index].float()  # (parts, T, r, in)
    low = torch.einsum("tk,ptjk->tpj", x.float(), own).reshape(T, parts * rank)
    return low * has


def lora_expand_torch(
    low: torch.Tensor, b_rows: torch.Tensor, lora_slots: torch.Tensor, rank: int, out: torch.Tensor
) -> None:
    index, has = _own_slot(lora_slots)
    own = b_rows.view(-1, rank, b_rows.shape[1])[index].float()  # (T, r, n)
    delta = torch.bmm((low[:, :rank] * has)[:, None, :], own)[:, 0]  # (T, n)
    out.copy_(torch.where(has.bool(), out.float() + delta, out.float()).to(out.dtype))
