"""Wire forms derived from dataclass annotations, never from hand-written field lists.

`to_wire` turns a message dataclass into a msgpack map of its fields; `from_wire` builds one back
from what a peer sent, checking every field against its annotation before anything uses it:
the exact set of keys, scalar types (an int is not a bool, a float is finite), lists, dicts,
optionals, byte strings and nested dataclasses, and sizes (string and blob lengths, item
counts). Integers on this wire are counts, indices, token ids and addresses, so they must be
non-negative too.

Tensor-valued fields (`torch.Tensor`, or `dict[str, torch.Tensor]`: tensors by name) never go in
a header: `tensor_fields` names them so that a message can carry them as frames, matched by
name.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

import torch

# Bounds on what one header may hold: far above what a real handover needs (a room id is at most
# 128 characters, a heartbeat names the rooms one decode worker has pending), far below what
# would let one message cost a worker real memory or time.
MAX_STRING = 4096
MAX_ITEMS = 1 << 16
MAX_INT = 1 << 62
# An opaque blob (a transfer engine's agent metadata: a few hundred bytes per backend and region).
MAX_BLOB = 1 << 20


class ProtocolError(ValueError):
    """A message that does not parse, has the wrong schema, or fails authentication; the text
    names the field. `room` is the room the message claimed to be about, when it said one."""

    room: str | None = None


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in declaration order."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in fields(cls)}


def _holds_tensors(hint: Any) -> bool:
    return hint is torch.Tensor or (
        typing.get_origin(hint) is dict and typing.get_args(hint)[1] is torch.Tensor
    )


@functools.cache
def tensor_fields(cls: type) -> tuple[str, ...]:
    return tuple(name for name, hint in hints(cls).items() if _holds_tensors(hint))


@functools.cache
def header_fields(cls: type) -> tuple[str, ...]:
    return tuple(name for name, hint in hints(cls).items() if not _holds_tensors(hint))


def to_wire(value: Any) -> dict[str, Any]:
    """msgpack's `default` hook: a dataclass as the map of its non-tensor fields (msgpack itself
    recurses into their values)."""
    if not is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"cannot encode {type(value).__name__}")
    return {name: getattr(value, name) for name in header_fields(type(value))}


def from_wire(cls: type, raw: Any, where: str, **tensors: torch.Tensor) -> Any:
    """Build dataclass `cls` from a received map (its non-tensor fields) plus its tensors."""
    return cls(**header_from_wire(cls, raw, where), **tensors)


def header_from_wire(cls: type, raw: Any, where: str) -> dict[str, Any]:
    """The checked (and, for nested dataclasses, built) non-tensor fields of `cls`."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    names = header_fields(cls)
    if set(raw) != set(names):
        raise ProtocolError(f"{where}: fields {sorted(map(str, raw))} do not match {sorted(names)}")
    field_hints = hints(cls)
    return {name: check(raw[name], field_hints[name], f"{where}.{name}") for name in names}


def check(value: Any, hint: Any, where: str) -> Any:
    """`value` if it matches `hint` (a float field accepts an int and gets a float), else
    ProtocolError naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return check(value, option, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {_describe(value)} is none of {_name(hint)}")
    if hint is object:  # a carrier's header, checked against the carrier before (protocol)
        return value
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected null, got {_describe(value)}")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a bool, got {_describe(value)}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProtocolError(f"{where}: expected an int, got {_describe(value)}")
        if not 0 <= value <= MAX_INT:
            raise ProtocolError(f"{where}: {value} is outside [0, 2**62]")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: {value} is not finite")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {_describe(value)}")
        if len(value) > MAX_STRING:
            raise ProtocolError(f"{where}: {len(value)} characters, at most {MAX_STRING}")
        return value
    if hint is bytes:
        if not isinstance(value, bytes):
            raise ProtocolError(f"{where}: expected bytes, got {_describe(value)}")
        if len(value) > MAX_BLOB:
            raise ProtocolError(f"{where}: {len(value)} bytes, at most {MAX_BLOB}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {_describe(value)}")
        _check_count(value, where)
        return [check(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {_describe(value)}")
        _check_count(value, where)
        return {
            check(k, args[0], f"{where} key"): check(v, args[1], f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if is_dataclass(hint):
        return from_wire(hint, value, where)
    raise ProtocolError(f"{where}: no wire form for {_name(hint)}")


def _check_count(value: list | dict, where: str) -> None:
    if len(value) > MAX_ITEMS:
        raise ProtocolError(f"{where}: {len(value)} items, at most {MAX_ITEMS}")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
