"""What the frames of each state message must be, derived from the receiving engine's handover
layout (its state spec): names, shapes and dtypes. Everything a peer sends is checked against
these before a byte of it reaches the pools; a mismatch is a ValueError naming the frame.

    PagesChunk     "pool#layer"  (n, page_size, *shape)     every paged tensor and layer, one n
    SlotChunk      "pool#layer"  (*shape)                   the units from first_unit on
    StateTransfer  "pages/pool"        (layers, n, page_size, *shape)
                   "slots/pool"        (layers, *shape), or (0, ...) when every layer came ahead
                   "checkpoints/pool"  (blocks, layers, *shape), one block count
                   across TP sizes: every frame empty (the tensors went rank to rank), the
                   checkpoints' block count alone says which blocks the ranks sent
"""

from __future__ import annotations

import torch

from baton.disagg.protocol import check_frames
from baton.engine.handover.state import HandoverLayout, RequestState, SlotUnit


def pages_chunk(layout: HandoverLayout, tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """A PagesChunk's frames as pages[pool][layer], checked."""
    expected = {
        f"{t.name}#{layer}": ((-1, layout.page_size, *t.shape), t.dtype)
        for t in layout.of_kind("paged")
        for layer in range(t.layers)
    }
    check_frames(tensors, expected)
    if len({t.shape[0] for t in tensors.values()}) > 1:
        raise ValueError("frames of one chunk hold different page counts")
    return {
        t.name: [tensors[f"{t.name}#{layer}"] for layer in range(t.layers)]
        for t in layout.of_kind("paged")
    }


def slot_chunk(
    layout: HandoverLayout, first_unit: int, tensors: dict[str, torch.Tensor]
) -> list[SlotUnit]:
    """The slot units a SlotChunk's frames cover (from `first_unit` on), frames checked."""
    units = layout.slot_units()
    covered, frames = [], 0
    for unit in units[first_unit:]:
        if frames >= len(tensors):
            break
        covered.append(unit)
        frames += len(unit.frames)
    if not covered or frames != len(tensors):
        raise ValueError(
            f"{len(tensors)} frames from slot unit {first_unit} do not make whole units of the"
            f" {len(units)} this model has"
        )
    expected = {
        frame: (layout.tensor(name).shape, layout.tensor(name).dtype)
        for unit in covered
        for frame, name, _ in unit.frames
    }
    check_frames(tensors, expected)
    return covered


def check_state(layout: HandoverLayout, state: RequestState, sharded: bool) -> None:
    """A StateTransfer's request state against this engine's layout."""
    for field, kind in (("pages", "paged"), ("slots", "slot"), ("checkpoints", "slot")):
        want = {t.name for t in layout.of_kind(kind) if field != "checkpoints" or t.checkpointed}
        got = set(getattr(state, field))
        if got != want:
            raise ValueError(f"state {field} of {sorted(got)}, expected {sorted(want)}")
    if sharded:
        if any(t.numel() for f in (state.pages, state.slots) for t in f.values()):
            raise ValueError("a state sent rank to rank carries no pages and no slot state")
        if len({t.shape[0] for t in state.checkpoints.values()}) > 1:
            raise ValueError("checkpoints of different block counts")
        return
    expected: dict[str, tuple[tuple[int, ...], str]] = {}
    slot_layers = {t.shape[0] for t in state.slots.values()}
    for t in layout.tensors:
        if t.kind == "paged":
            expected[f"pages/{t.name}"] = ((t.layers, -1, layout.page_size, *t.shape), t.dtype)
            continue
        layers = t.layers if slot_layers != {0} else 0
        expected[f"slots/{t.name}"] = ((layers, *t.shape), t.dtype)
        if t.checkpointed:
            expected[f"checkpoints/{t.name}"] = ((-1, t.layers, *t.shape), t.dtype)
    frames = {
        f"{f}/{n}": t
        for f in ("pages", "slots", "checkpoints")
        for n, t in getattr(state, f).items()
    }
    check_frames(frames, expected)
    for field in ("pages", "checkpoints"):
        counts = {t.shape[1 if field == "pages" else 0] for t in getattr(state, field).values()}
        if len(counts) > 1:
            raise ValueError(f"state {field} of different counts: {sorted(counts)}")
