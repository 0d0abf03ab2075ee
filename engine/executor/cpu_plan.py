"""A captured CPU step: the decode (or verify) forward recorded once at the dispatcher and
replayed in C++ (kernels/cpu/extension.py's `Plan`), with no Python per layer or operator.

The CPU's answer to a CUDA graph. The graph runner runs a padded step over its fixed metadata
buffers (the one builder's, as for CUDA graphs) under `record()`, a TorchDispatchMode that
sees every operator the step calls: aten's, oneDNN's and baton's C kernels (torch operators
since issue 52). What it keeps, per call:
- a view or alias (its outputs share storage with its inputs: `view`, `slice`, `t`,
  `_unsafe_view`, ...) is nothing to replay: the view recorded over a fixed buffer stays one;
- `empty*` is nothing either: the tensor recorded stays allocated, and the calls that fill it
  are recorded;
- a call that writes its arguments (in-place, `out=`, a baton kernel) is replayed as is, and a
  baton kernel's integer result is checked to be 0 (its error code) on every replay; so is a
  collective's wait (tensor parallelism's all-reduces are operators too: engine/parallel);
- a functional call is replayed through its `out=` overload into the tensors it returned when
  recorded (where its overload packet has one with the same arguments), else called and its
  results copied into those tensors.
So every tensor the step reads after the first call is one of the recorded ones, refilled in
place, and the recorded arguments (fixed buffers, pools, weights, recorded intermediates) are
all a replay needs.

What cannot be recorded makes the capture fail (`CaptureError`) and that step shape runs eagerly
from then on: a call that hands a host value back to Python (`.item()`, `bool(t)`, an op
returning an int or a float: Python may branch on it, and a replay would not ask again) and the
operators whose output shape follows the data (`nonzero`, boolean-mask indexing, ...). Python control
flow on host values outside tensors (the metadata's host fields) is fixed by the graph runner,
which keys plans by (mode, batch size, tracking) and refuses a replay whose host values differ
from the recorded step's (static_copy.copy_from), as for CUDA graphs.

Intermediates are not pooled: a plan holds every tensor its step made (a few MiB at the batch
sizes the runner captures on the CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.cpu.extension import load as load_extension

aten = torch.ops.aten

# Calls that only allocate: the recorded tensor stays, the calls that fill it are replayed.
_ALLOCATIONS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
# Output shapes that follow the data: a replay would keep the recorded shape.
_DATA_SHAPED = frozenset(
    {
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::argwhere",
        "aten::masked_select",
        "aten::unique_consecutive",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::repeat_interleave",
        "aten::bincount",
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::allclose",
    }
)


# Calls made for what they wait on, whose result is their input: a collective's wait (the gloo
# work a replayed `all_reduce_` started is done once it returns), replayed as they are.
_WAITS = frozenset({"_c10d_functional::wait_tensor"})
# Indexing whose rows a boolean mask picks (x[mask]): how many follows the data.
_INDEXING = frozenset(
    {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
)


def _masks(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, torch.Tensor) and v.dtype in (torch.bool, torch.uint8) for v in value
    )


class CaptureError(RuntimeError):
    """The step called something a replay cannot reproduce."""


def _storages(value: Any) -> set[int]:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:  # oneDNN's packed weights: opaque, only ever read
            return set()
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, (list, tuple)):
        return set().union(*map(_storages, value)) if value else set()
    return set()


def _full_args(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> list:
    """Every argument of `schema` in order: positional, then keywords, then defaults."""
    full = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            full.append(args[i])
        elif arg.name in kwargs:
            full.append(kwargs[arg.name])
        elif arg.has_default_value():
            full.append(arg.default_value)
        else:
            raise CaptureError(f"{schema.name}: no value for argument {arg.name!r}")
    return full


def _writes(schema: torch.FunctionSchema) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _out_overload(func: torch._ops.OpOverload) -> str | None:
    """The overload of func's packet that takes func's arguments plus one `out` tensor per
    result (aten's `.out` / `.Tensor_out` variants), or None."""
    schema = func._schema
    names = [(a.name, str(a.type)) for a in schema.arguments]
    for name in func.overloadpacket.overloads():
        other = getattr(func.overloadpacket, name)._schema
        ins = [a for a in other.arguments if not (a.alias_info and a.alias_info.is_write)]
        outs = [a for a in other.arguments if a.alias_info and a.alias_info.is_write]
        if (
            [(a.name, str(a.type)) for a in ins] == names
            and len(outs) == len(schema.returns)
            and all(a.kwarg_only and str(a.type) == "Tensor" for a in outs)
        ):
            return name
    return None


class Recorder(TorchDispatchMode):
    """Runs the step as it is and records what a replay must call (see the module docstring)."""

    def __init__(self, plan: Any):
        super().__init__()
        self.plan = plan
        self.error: str | None = None
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.error is None:
            try:
                self._record(func, args, kwargs, out)
            except CaptureError as error:
                self.error = str(error)
        return out

    def _append(
        self, name: str, overload: str, args: list, copy_into: list, check_zero: bool
    ) -> None:
        # the dispatcher names an operator's default overload ""
        self.plan.append(name, "" if overload == "default" else overload, args, copy_into,
                         check_zero)  # fmt: skip

    def _record(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        self.calls += 1
        schema = func._schema
        if schema.name in _DATA_SHAPED:
            raise CaptureError(f"{schema.name} cannot be replayed (its result follows the data)")
        if func in _ALLOCATIONS:
            return
        namespace, name = schema.name.split("::")
        full = _full_args(schema, args, kwargs)
        if schema.name in _INDEXING and any(_masks(value) for value in full):
            raise CaptureError(f"{schema.name} with a boolean mask: its rows follow the data")
        if isinstance(out, int) and namespace != "aten":  # a C kernel's error code
            if out != 0:
                raise CaptureError(f"{schema.name} returned {out} while recorded")
            self._append(f"{namespace}::{name}", func._overloadname, full, [], True)
            return
        if _writes(schema) or schema.name in _WAITS:
            self._append(f"{namespace}::{name}", func._overloadname, full, [], False)
            return
        results = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(r, torch.Tensor) for r in results):
            raise CaptureError(f"{schema.name} hands Python a host value ({type(out).__name__})")
        if _storages(results) <= _storages(full):  # a view or alias of its inputs
            return
        if _storages(results) & _storages(full):
            raise CaptureError(f"{schema.name} returns a mix of new and aliased tensors")
        if schema.name == "aten::linear" and self._as_matmul(full, results):
            return
        overload = _out_overload(func)
        if overload is not None:
            ins, outs = iter(full), iter(results)
            out_args = [
                next(outs) if a.alias_info is not None and a.alias_info.is_write else next(ins)
                for a in getattr(func.overloadpacket, overload)._schema.arguments
            ]
            self._append(f"{namespace}::{name}", overload, out_args, [], False)
        else:
            self._append(f"{namespace}::{name}", func._overloadname, full, list(results), False)

    def _as_matmul(self, full: list, results: tuple) -> bool:
        """A 2-D `linear` recorded as what aten's linear calls for it, `mm` (or `addmm` with a
        bias) on the weight's transpose, into its recorded output: a replay then makes one
        dispatcher call instead of four (linear, matmul, t, mm: ~3 us of a ~10 us call on a small
        model's weights). False where linear would do something else (other ranks of input)."""
        x, weight, bias = full
        (out,) = results
        if x.dim() != 2 or weight.dim() != 2 or out.dim() != 2:
            return False
        if bias is None:
            self._append("aten::mm", "out", [x, weight.t(), out], [], False)
        else:
            self._append("aten::addmm", "out", [bias, x, weight.t(), 1, 1, out], [], False)
        return True


def plans_available() -> bool:
    """Whether the C++ extension (and so `Plan`) is built and enabled."""
    return cpu_library() is not None


def new_plan() -> Any:
    """An empty Plan of the C++ extension (RuntimeError when it cannot be built)."""
    return load_extension().Plan()
