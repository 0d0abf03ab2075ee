"""baton's C kernels as torch operators, and the replay of a captured CPU step, in one C++
extension built once per machine.

Every kernel in kernels/cpu/*.c is a plain C function over pointers and integers. This module
reads their signatures from the sources and generates the extension: each kernel becomes an
operator `torch.ops.baton.<name>` whose schema says which tensors it writes (a non-`const`
pointer is `Tensor(x!)`), with a meta implementation for tracing, called through the
dispatcher like any aten operator (no ctypes). Being operators, they are what a dispatch-level
capture records (engine/executor/cpu_plan.py), and `Plan` replays such a record in C++: the
whole decode step without Python per operator.

The C sources are compiled as C (their flags: -O3 -march=native, OpenMP) and linked with the
generated C++ into one shared object, cached under $BATON_CACHE_DIR keyed by the sources, the
flags, the compilers, the CPU and torch's version. `make install` builds it
(`python -m baton.kernels.cpu.build`); without a compiler, without torch's headers, or with
BATON_CPU_OPS=0, `load()` returns None and every caller runs its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from baton.kernels.machine_cache import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
MODULE = "baton_cpu_ext"
C_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11"]
# What a CPU without AVX-512 compiles: the kernels' portable loops (tests compare the two builds).
PORTABLE_FLAGS = [f if f != "-march=native" else "-march=x86-64-v3" for f in C_FLAGS]
CXX_FLAGS = ["-O2", "-march=native", "-fPIC", "-std=c++20", "-w"]

_SIGNATURE = re.compile(r"^(int64_t|int|void)\s+(baton_\w+)\s*\(([^)]*)\)\s*\{", re.M)
_C_TYPES = {"int64_t": "int64_t", "int": "int", "float": "float"}
_SCHEMA_TYPES = {"int64_t": "int", "int": "int", "float": "float"}
_CXX_TYPES = {"int64_t": "int64_t", "int": "int64_t", "float": "double"}


def enabled() -> bool:
    return os.environ.get("BATON_CPU_OPS", "1").strip() not in ("0", "false", "no")


def cpu_key() -> str:
    """This CPU's feature flags (/proc/cpuinfo): what a build or a timing made here is valid for."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "in" / "out" (a pointer the kernel reads / writes), "int64_t", "int", "float"


@dataclass(frozen=True)
class Kernel:
    name: str
    returns: str  # "int64_t", "int" or "void"
    params: tuple[Param, ...]

    @property
    def is_query(self) -> bool:
        """No pointer: a capability query or setting (baton_gemm_supported), called directly."""
        return not any(p.kind in ("in", "out") for p in self.params)

    def schema(self) -> str:
        args, written = [], 0
        for p in self.params:
            if p.kind == "in":
                args.append(f"Tensor? {p.name}")
            elif p.kind == "out":
                args.append(f"Tensor(w{written}!)? {p.name}")
                written += 1
            else:
                args.append(f"{_SCHEMA_TYPES[p.kind]} {p.name}")
        returns = "()" if self.returns == "void" else "int"
        return f"{self.op}({', '.join(args)}) -> {returns}"

    @property
    def op(self) -> str:
        """Its operator's name: torch.ops.baton.<op> (the C name without `baton_`)."""
        return self.name.removeprefix("baton_")


def _param(text: str) -> Param | None:
    text = " ".join(text.split())
    if text in ("", "void"):
        return None
    if "*" in text:
        name = text.rsplit("*", 1)[1].strip()
        return Param(name, "in" if text.startswith("const ") else "out")
    ctype, name = text.rsplit(" ", 1)
    if ctype not in _C_TYPES:
        raise ValueError(f"kernel parameter {text!r}: no operator type for {ctype}")
    return Param(name, ctype)


def kernels(sources: list[Path]) -> list[Kernel]:
    """The exported kernels (`int64_t|int|void baton_*(...) {`) of each source, in order."""
    found = []
    for source in sources:
        for returns, name, params in _SIGNATURE.findall(source.read_text()):
            parsed = tuple(p for p in map(_param, params.split(",")) if p is not None)
            found.append(Kernel(name=name, returns=returns, params=parsed))
    return found


def generate(found: list[Kernel], namespace: str = "baton", module: str = MODULE) -> str:
    """The C++ of the extension: one operator per kernel (torch.ops.<namespace>), the queries
    as functions of the Python module `module`, and the captured-step `Plan`."""
    decls, impls, defs, regs, queries = [], [], [], [], []
    for k in found:
        c_params = ", ".join("void*" if p.kind in ("in", "out") else p.kind for p in k.params)
        decls.append(f"{k.returns} {k.name}({c_params or 'void'});")
        if k.is_query:
            call = ", ".join(f"({p.kind}){p.name}" for p in k.params)
            args = ", ".join(f"int64_t {p.name}" for p in k.params)
            queries.append(
                f'  m.def("{k.name}", []({args}) {{ return (int64_t){k.name}({call}); }});'
            )
            continue
        args = ", ".join(
            f"const std::optional<at::Tensor>& {p.name}"
            if p.kind in ("in", "out")
            else f"{_CXX_TYPES[p.kind]} {p.name}"
            for p in k.params
        )
        call = ", ".join(
            f"ptr({p.name})" if p.kind in ("in", "out") else f"({p.kind}){p.name}" for p in k.params
        )
        ret = "void" if k.returns == "void" else "int64_t"
        body = f"{k.name}({call});" if ret == "void" else f"return (int64_t){k.name}({call});"
        impls.append(f"{ret} op_{k.name}({args}) {{\n  NoGil nogil;\n  {body}\n}}")
        defs.append(f'  m.def("{k.schema()}");')
        regs.append(f'  m.impl("{k.op}", &op_{k.name});')
    return _TEMPLATE.format(
        decls="\n".join(decls),
        impls="\n\n".join(impls),
        defs="\n".join(defs),
        regs="\n".join(regs),
        queries="\n".join(queries),
        namespace=namespace,
        module=module,
    )


_TEMPLATE = r"""// Generated by baton/kernels/cpu/extension.py from kernels/cpu/*.c: do not edit.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/python_variable.h>

extern "C" {{
{decls}
}}

namespace {{

void* ptr(const std::optional<at::Tensor>& t) {{ return t.has_value() ? t->data_ptr() : nullptr; }}

// The kernels run OpenMP loops for milliseconds: the GIL goes while they do (as ctypes let it
// go), when the caller holds it (a replay has released it already).
struct NoGil {{
  PyThreadState* state = nullptr;
  NoGil() {{ if (Py_IsInitialized() && PyGILState_Check()) state = PyEval_SaveThread(); }}
  ~NoGil() {{ if (state) PyEval_RestoreThread(state); }}
}};

{impls}

// A captured step: operator calls with their arguments fixed, replayed in order.
struct Entry {{
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<at::Tensor> copy_into;  // a functional call's results land in these
  bool check_zero;  // a baton kernel: a non-zero result is its error code
  std::string name;
}};

class Plan {{
 public:
  void append(const std::string& name, const std::string& overload, py::list args,
              std::vector<at::Tensor> copy_into, bool check_zero) {{
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    if (args.size() != schema.arguments().size())
      throw std::invalid_argument(name + ": " + std::to_string(args.size()) + " arguments for " +
                                  std::to_string(schema.arguments().size()));
    std::vector<c10::IValue> stack;
    for (size_t i = 0; i < args.size(); ++i) {{
      const auto& type = schema.arguments()[i].real_type();
      py::handle arg = args[i];
      if (type->kind() == c10::TypeKind::TensorType && !THPVariable_Check(arg.ptr())) {{
        // a Python number where aten takes a Tensor (x * 2): the wrapped number Python's
        // argument parser makes, which type promotion treats as a scalar
        at::Tensor number = c10::scalar_to_tensor(torch::jit::toIValue(arg, c10::NumberType::get()).toScalar());
        number.unsafeGetTensorImpl()->set_wrapped_number(true);
        stack.push_back(number);
      }} else {{
        stack.push_back(torch::jit::toIValue(arg, type));
      }}
    }}
    entries_.push_back(Entry{{op, std::move(stack), std::move(copy_into), check_zero,
                             name + "." + overload}});
  }}

  void replay() {{
    c10::InferenceMode inference;
    for (auto& e : entries_) {{
      torch::jit::Stack stack(e.args.begin(), e.args.end());
      e.op.callBoxed(&stack);
      if (e.check_zero && stack.at(0).toInt() != 0)
        throw std::runtime_error(e.name + " failed with code " +
                                 std::to_string(stack.at(0).toInt()) + " in a replayed step");
      for (size_t i = 0; i < e.copy_into.size(); ++i) e.copy_into[i].copy_(stack.at(i).toTensor());
    }}
  }}

  size_t size() const {{ return entries_.size(); }}

 private:
  std::vector<Entry> entries_;
}};

}}  // namespace

TORCH_LIBRARY({namespace}, m) {{
{defs}
}}

TORCH_LIBRARY_IMPL({namespace}, CPU, m) {{
{regs}
}}

PYBIND11_MODULE({module}, m) {{
  py::class_<Plan>(m, "Plan")
      .def(py::init<>())
      .def("append", &Plan::append)
      .def("replay", &Plan::replay, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &Plan::size);
{queries}
}}
"""


def _compilers() -> tuple[str, str] | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return (cc, cxx) if cc and cxx else None


def _torch_paths() -> tuple[list[str], str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return includes, os.path.join(os.path.dirname(torch.__file__), "lib")


def sources() -> list[Path]:
    return sorted(HERE.glob("*.c"))


def _key(sources: list[Path], shim: str, c_flags: list[str], cc: str, cxx: str) -> str:
    digest = hashlib.sha256()
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})  # cpu/common.h ...
    for source in [*sources, *headers]:
        digest.update(source.name.encode() + source.read_bytes())
    for part in (shim, " ".join(c_flags + CXX_FLAGS), cc, cxx, cpu_key(), torch.__version__):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def build(
    kernel_sources: list[Path] | None = None,
    c_flags: list[str] | None = None,
    namespace: str = "baton",
) -> Path:
    """The extension for `kernel_sources` (default: every kernels/cpu/*.c) compiled with
    `c_flags` (default C_FLAGS), its operators under torch.ops.<namespace>; built unless
    cached. Raises RuntimeError naming what is missing or what the compiler said."""
    kernel_sources = kernel_sources or sources()
    c_flags = c_flags or C_FLAGS
    compilers = _compilers()
    if compilers is None:
        raise RuntimeError("no C and C++ compiler found (CC / CXX, cc, gcc, c++, g++)")
    cc, cxx = compilers
    module = MODULE if namespace == "baton" else f"{MODULE}_{namespace}"
    shim = generate(kernels(kernel_sources), namespace, module)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = _key(kernel_sources, shim, c_flags, cc, cxx)
    target = cache_dir() / f"{module}-{key}" / f"{module}{suffix}"
    if target.exists():
        return target
    includes, torch_lib = _torch_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        (work / "ext.cpp").write_text(shim)
        objects = [work / f"{s.stem}.o" for s in kernel_sources]
        jobs = [[cc, *c_flags, "-c", str(s), "-o", str(o)] for s, o in zip(kernel_sources, objects)]
        ext = [cxx, *CXX_FLAGS, *(f"-I{i}" for i in includes), "-c", str(work / "ext.cpp")]
        jobs.append([*ext, "-o", str(work / "ext.o")])
        try:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                list(pool.map(_run, jobs))
            out = work / target.name
            _run(
                [cxx, "-shared", "-fopenmp", str(work / "ext.o"), *map(str, objects)]
                + [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]
                + ["-ltorch", "-ltorch_python", "-lm", "-o", str(out)]
            )
        except subprocess.CalledProcessError as error:
            raise RuntimeError((error.stderr or str(error))[-4000:]) from None
        except OSError as error:
            raise RuntimeError(f"cannot run the compiler: {error}") from None
        os.replace(out, target)  # atomic: concurrent builders race harmlessly
    return target


def _register_fakes(namespace: str, found: list[Kernel]) -> None:
    """Meta implementations: a kernel writes only its arguments and returns 0 or nothing."""
    for k in found:
        if k.is_query:
            continue
        result = None if k.returns == "void" else 0
        torch.library.register_fake(f"{namespace}::{k.op}")(
            lambda *args, _result=result, **kwargs: _result
        )


@functools.cache
def load(c_flags: tuple[str, ...] = tuple(C_FLAGS), namespace: str = "baton") -> ModuleType:
    """The extension built with `c_flags`, imported (its operators registered under
    torch.ops.<namespace>) once per process. RuntimeError when it cannot be built or loaded."""
    path = build(sources(), list(c_flags), namespace)
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise RuntimeError(f"cannot load {path}: {error}") from None
    _register_fakes(namespace, kernels(sources()))
    return module


class Kernels:
    """The kernels by their C names, as kernels/cpu/*.py call them: `lib.baton_gemm(x, m, ...)`
    is the operator torch.ops.<namespace>.gemm (tensors where the C function takes pointers,
    None for NULL); a query (`lib.baton_gemm_supported()`) is the extension's function."""

    def __init__(self, module: ModuleType, namespace: str = "baton"):
        self._module = module
        self._namespace = namespace

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        found = getattr(self._module, name, None)
        if found is None:
            ops = getattr(torch.ops, self._namespace)
            found = getattr(ops, name.removeprefix("baton_")).default
        setattr(self, name, found)  # looked up once
        return found


_warned: list[str] = []


def library() -> Kernels | None:
    """Every C kernel, or None (BATON_CPU_OPS=0, or no build: one warning; each caller then
    runs its torch path)."""
    if not enabled():
        return None
    try:
        return Kernels(load())
    except RuntimeError as error:
        if not _warned:
            _warned.append(str(error))
            log.warning("the C kernels could not be built (the torch paths run): %s", error)
        return None


def variant(c_flags: list[str], namespace: str) -> Kernels:
    """The kernels built with other C flags (a portable -march, in tests), beside the default
    build: their operators live under torch.ops.<namespace>."""
    return Kernels(load(tuple(c_flags), namespace), namespace)
