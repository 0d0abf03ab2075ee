"""Refilling a captured step's metadata: `copy_from` copies every tensor of a freshly built
Mamba2Metadata into the matching tensor of the one a CUDA graph or CPU plan captured (same
structure), skips a part built in place in the fixed buffers, refuses a part that moved within
them, and refuses a host value that differs from the captured step's (a graph or plan is keyed
by its host facts)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# type -> how copy_from walks its values: "tensor", field names (a dataclass or a NamedTuple),
# or None (a host value, compared)
_WALKS: dict[type, str | tuple[str, ...] | None] = {}


def _walk(kind: type) -> str | tuple[str, ...] | None:
    walk = _WALKS.get(kind, ())
    if walk == ():
        if issubclass(kind, torch.Tensor):
            walk = "tensor"
        elif dataclasses.is_dataclass(kind):
            walk = tuple(f.name for f in dataclasses.fields(kind))
        elif issubclass(kind, tuple) and hasattr(kind, "_fields"):  # NamedTuple layouts
            walk = kind._fields
        else:
            walk = None
        _WALKS[kind] = walk
    return walk


def copy_from(static: Any, new: Any) -> None:
    """Copy every tensor of `new` into the matching tensor of `static` (same structure)."""
    if static is new:  # a part reused from step to step (a staged view, an empty layout)
        return
    walk = _walk(type(static))
    if walk == "tensor":
        if static.shape != new.shape:
            raise ValueError(f"static buffer {tuple(static.shape)} cannot take {tuple(new.shape)}")
        if static.data_ptr() == new.data_ptr() and static.stride() == new.stride():
            return  # built in place (the decode token table): no copy as wide as the capacity
        if static.untyped_storage().data_ptr() == new.untyped_storage().data_ptr():
            # the builder moved a part within the fixed buffers: copying it back could
            # overwrite parts not yet copied
            raise ValueError("a metadata part moved within the fixed buffers between steps")
        static.copy_(new)
    elif walk is not None:
        for name in walk:
            copy_from(getattr(static, name), getattr(new, name))
    elif static != new:
        raise ValueError(f"host value changed between capture and replay: {static!r} -> {new!r}")
