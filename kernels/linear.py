"""CPU linear layers on weights prepacked once into oneDNN's blocked layout.

`F.linear` on the CPU repacks the weight on every call; for the few-row matmuls of decode (and
the wide lm_head) that repacking costs more than the multiply. Reordering the weight once at load
time (`torch.ops.mkldnn._reorder_linear_weight`) and calling `_linear_pointwise` runs 1.2-3x
faster on this project's shapes (bench numbers in the engine issue's note), with the same
float32 accumulation. `pack_linears` swaps every `nn.Linear` of a model for a `PackedLinear`;
dtypes oneDNN cannot run on this CPU keep `nn.Linear`.

The matmul dtype is chosen at load. Whether a bf16 GEMM beats the fp32 one depends on the CPU:
without AVX512-BF16/AMX, oneDNN's bf16 runs at about half the fp32 rate; with them (this
project's dev VM), at about twice. `MatmulChooser` times both forms for each weight shape of the
model (a few ms per shape, the output width capped so the lm_head costs no more than the rest)
and a bf16/fp16 model's `PackedLinear` then holds its weight in the faster dtype. A float32
weight computes from the model-dtype input (exact: bf16/fp16 widen losslessly) with the same
float32 accumulation, and its output is cast back to the model dtype, so every layer downstream
sees the dtype, and the rounding point, it always did. `BATON_CPU_MATMUL_DTYPE` forces a form:
`model` (the model's dtype), `float32`, or `auto` (default: timed).

Small weights (at most SMALL_WEIGHT elements) also time decode's few rows (up to PLAIN_ROWS) as
`F.linear` on the plain weight against their GEMM: oneDNN's fixed cost per call (45-55 us on an
AVX2 EPYC without AVX-512, where a 192 x 384 gemv takes 9-21 us through `F.linear`) outweighs the
multiply there, and a tiny model's decode step is made of such calls. Where the plain form wins,
the linear keeps that plain copy beside its packed one (small by definition) and runs decode rows
on it, prefill rows on the packed GEMM.

The GEMM is chosen the same way, per shape and compute dtype: oneDNN's prepacked linear or
baton's own (kernels/cpu/gemm.c: AVX-512 / AVX512-BF16 panels with the next panel prefetched,
1.3-1.4x oneDNN on decode's few rows over weights larger than the caches, on a par at prefill's
hundreds; with AMX, bf16 from 8 rows on tiles: 1.5-2x oneDNN at 1-4 rows, on a par at 16-256).
`MatmulChooser.kernel` times both where this CPU runs baton's (where oneDNN wins, it stays);
`BATON_CPU_GEMM` forces `onednn` or `baton`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from baton.kernels.cpu import gemm as cpu_gemm
from baton.kernels.matmul_choices import ChoiceCache

log = logging.getLogger(__name__)

MATMUL_DTYPE_ENV = "BATON_CPU_MATMUL_DTYPE"
POLICIES = ("auto", "model", "float32")
GEMM_ENV = "BATON_CPU_GEMM"
GEMM_POLICIES = ("auto", "onednn", "baton")
TIMING_ROWS = (16, 64)  # decode-like and prefill-like row counts, timed and summed
TIMING_ROUNDS = 3  # alternated rounds per shape (see MatmulChooser)
TIMING_MAX_OUT = 2048  # columns timed per shape: the rate of a 32000-wide lm_head is the same
# fp32 must beat the model dtype by this much: the casts it adds cost a little in every layer,
# and a near-tie is noise on a loaded machine
FLOAT32_MARGIN = 0.9
# baton's GEMM is kept unless oneDNN beats it by more than this: the timing runs on weights
# that stay in cache, where the next-panel prefetch that makes baton's 1.3-1.4x faster on
# decode's cold weights gains little (1.0-1.1x, and a near-tie flipped with load: one of a PD
# pair's two workers, timing at the same moment, once picked oneDNN for the 768x5144 in_proj).
BATON_GEMM_MARGIN = 1.15
# Where baton's GEMM runs bf16 on AMX (kernels/cpu/gemm.c), both GEMMs run AMX from 8 rows, on a
# par over weights larger than the caches (0.9-1.3x at 16-256 rows on the 110M model's shapes,
# a Xeon with AMX), 5-18% apart on the hot weights timed here; at decode's 1-4 rows baton's
# register kernels stream the weights at 1.5-2x oneDNN's rate, which no hot timing shows (timed
# at load, one row read 0.85-1.3x, noise). Its margin there is wider: a near-tie at 16 and 64
# rows picked oneDNN for half a batch-1 decode step's weights.
AMX_GEMM_MARGIN = 1.5
# Weights up to this many elements (1 MiB of float32) time the plain F.linear at decode's rows
SMALL_WEIGHT = 1 << 18
PLAIN_ROWS = 8  # rows up to which a linear that keeps a plain copy runs on it
PLAIN_TIMING_ROWS = (1, PLAIN_ROWS)
PLAIN_MARGIN = 0.9  # the plain form must beat the GEMM by this much to earn its copy
# What the timings above depend on: choices kept on disk (kernels/matmul_choices.py) are keyed by it.
TIMING_RULES = (
    f"rows {TIMING_ROWS} rounds {TIMING_ROUNDS} max-out {TIMING_MAX_OUT} "
    f"margins {FLOAT32_MARGIN} {BATON_GEMM_MARGIN} amx {AMX_GEMM_MARGIN} plain {SMALL_WEIGHT} {PLAIN_TIMING_ROWS} "
    f"{PLAIN_MARGIN}"
)


def can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return False


def matmul_policy() -> str:
    """`BATON_CPU_MATMUL_DTYPE` (default auto); anything else is an error naming the variable."""
    policy = os.environ.get(MATMUL_DTYPE_ENV, "auto").strip().lower() or "auto"
    if policy not in POLICIES:
        raise ValueError(f"{MATMUL_DTYPE_ENV}={policy!r}: expected one of {', '.join(POLICIES)}")
    return policy


def gemm_policy() -> str:
    """`BATON_CPU_GEMM` (default auto); anything else is an error naming the variable."""
    policy = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if policy not in GEMM_POLICIES:
        raise ValueError(f"{GEMM_ENV}={policy!r}: expected one of {', '.join(GEMM_POLICIES)}")
    return policy


def _operand(*shape: int) -> torch.Tensor:
    """A timing's random operand, from its own generator: timing at load must not move the
    process's random state (a seeded run's first sample would depend on the shapes timed)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _best_of(fn: Callable[..., object], *args: object, repeats: int = 3) -> float:
    fn(*args)  # warm-up: oneDNN builds its kernel for the shape on the first call
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def _packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _upcast_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return _packed_mm(x.float(), packed).to(x.dtype)


def time_linear(in_features: int, out_features: int, dtype: torch.dtype, form: str) -> float:
    """Seconds for one (in, out) linear of a `dtype` model, summed over TIMING_ROWS, as the
    forward runs it: form "model" computes in `dtype` (packed where oneDNN packs it, else
    F.linear); "float32" widens the input, runs the fp32 packed matmul, narrows the output."""
    out_features = min(out_features, TIMING_MAX_OUT)
    weight = _operand(out_features, in_features)
    if form == "float32":
        fn, w = _upcast_mm, torch.ops.mkldnn._reorder_linear_weight(weight, None)
    elif can_pack(dtype):
        fn, w = _packed_mm, torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
    else:
        fn, w = torch.nn.functional.linear, weight.to(dtype)
    return sum(_best_of(fn, _operand(rows, in_features).to(dtype), w) for rows in TIMING_ROWS)


def _gemm(weight: torch.Tensor, kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T on `kernel` ("onednn" | "baton"), the weight packed for it once."""
    if kernel == "baton":
        packed = cpu_gemm.pack(weight)
        return lambda x: cpu_gemm.linear(x, packed, weight.shape[0])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda x: _packed_mm(x, packed)


def time_gemm(in_features: int, out_features: int, dtype: torch.dtype, kernel: str) -> float:
    """Seconds for one (in, out) linear computing in `dtype` on `kernel` ("onednn" | "baton"),
    summed over TIMING_ROWS."""
    weight = _operand(min(out_features, TIMING_MAX_OUT), in_features).to(dtype)
    fn = _gemm(weight, kernel)
    return sum(_best_of(fn, _operand(rows, in_features).to(dtype)) for rows in TIMING_ROWS)


def time_decode_rows(
    in_features: int, out_features: int, dtype: torch.dtype, kernel: str, form: str
) -> float:
    """Seconds for one (in, out) linear computing in `dtype` at decode's rows, summed over
    PLAIN_TIMING_ROWS: form "gemm" on `kernel` ("onednn" | "baton"), form "plain" as
    F.linear on the unpacked weight."""
    weight = _operand(out_features, in_features).to(dtype)
    if form == "plain":
        fn = lambda x: torch.nn.functional.linear(x, weight)  # noqa: E731
    else:
        fn = _gemm(weight, kernel)
    return sum(_best_of(fn, _operand(rows, in_features).to(dtype)) for rows in PLAIN_TIMING_ROWS)


class MatmulChooser:
    """The dtype each linear of a `model_dtype` model computes in, per (in, out) shape, chosen
    once per shape, and the GEMM each runs on (`kernel`). `timer(in, out, "model" | "float32")
    -> seconds` and `gemm_timer(in, out, dtype, "onednn" | "baton") -> seconds` are injectable
    (tests give fake timings: the choices are pure functions of them)."""

    def __init__(
        self,
        model_dtype: torch.dtype,
        policy: str | None = None,
        timer: Callable[[int, int, str], float] | None = None,
        gemm: str | None = None,
        gemm_timer: Callable[[int, int, torch.dtype, str], float] | None = None,
        cache: ChoiceCache | None = None,
        decode_timer: Callable[[int, int, torch.dtype, str, str], float] | None = None,
        amx: bool | None = None,
    ):
        """decode_timer(in, out, dtype, kernel, "gemm" | "plain") -> seconds at decode's rows
        (default time_decode_rows); amx: whether baton's GEMM runs bf16 on AMX (default: this
        machine's build)."""
        self.model_dtype = model_dtype
        self.policy = matmul_policy() if policy is None else policy
        if self.policy not in POLICIES:
            raise ValueError(f"matmul dtype policy {self.policy!r}: expected one of {POLICIES}")
        self.timer = timer or self._time
        self.choices: dict[tuple[int, int], torch.dtype] = {}
        self.timings: dict[tuple[int, int], tuple[float, float]] = {}
        self.gemm = gemm_policy() if gemm is None else gemm
        if self.gemm not in GEMM_POLICIES:
            raise ValueError(f"GEMM policy {self.gemm!r}: expected one of {GEMM_POLICIES}")
        self.gemm_timer = gemm_timer or time_gemm
        self.kernels: dict[tuple[int, int, torch.dtype], str] = {}
        self.gemm_timings: dict[tuple[int, int, torch.dtype], tuple[float, float]] = {}
        self.cache = cache  # timings kept by earlier starts on this machine (None: time all)
        self.num_cached = 0  # shapes decided on kept timings, without timing
        self.decode_timer = decode_timer or time_decode_rows
        self.amx = amx
        # (in, out, dtype, kernel) -> (GEMM seconds, plain seconds) at decode's rows
        self.plain_timings: dict[tuple[int, int, torch.dtype, str], tuple[float, float]] = {}

    def _timed(self, key: str, time_both: Callable[[], tuple[float, float]]) -> tuple[float, float]:
        """(seconds of the first form, of the second) for `key`: kept ones once settled, else
        this start's, merged with the kept ones (the best of each form over the starts)."""
        settled = self.cache.settled(key) if self.cache is not None else None
        if settled is not None:
            self.num_cached += 1
            return settled
        first_s, second_s = time_both()
        if self.cache is None:
            return first_s, second_s
        return self.cache.record(key, first_s, second_s)

    def _time(self, in_features: int, out_features: int, form: str) -> float:
        return time_linear(in_features, out_features, self.model_dtype, form)

    def __call__(self, in_features: int, out_features: int) -> torch.dtype:
        if self.model_dtype == torch.float32 or self.policy == "model":
            return self.model_dtype
        fp32_packs = can_pack(torch.float32)
        if self.policy == "float32":
            return torch.float32 if fp32_packs else self.model_dtype
        if not fp32_packs:
            return self.model_dtype
        shape = (in_features, out_features)
        if shape not in self.choices:
            model_name = str(self.model_dtype).removeprefix("torch.")
            key = f"dtype {model_name} {in_features}x{out_features}"
            model_s, fp32_s = self._timed(key, lambda: self._time_dtypes(in_features, out_features))
            self.timings[shape] = (model_s, fp32_s)
            faster = fp32_s < FLOAT32_MARGIN * model_s
            self.choices[shape] = torch.float32 if faster else self.model_dtype
        return self.choices[shape]

    def _time_dtypes(self, in_features: int, out_features: int) -> tuple[float, float]:
        # Rounds alternate the two forms and keep each one's best: a burst of other work on
        # a shared machine then slows one round of both rather than all of one form (timed
        # back to back, one burst picked the slower dtype for a whole server's life).
        model_s = fp32_s = float("inf")
        for _ in range(TIMING_ROUNDS):
            model_s = min(model_s, self.timer(in_features, out_features, "model"))
            fp32_s = min(fp32_s, self.timer(in_features, out_features, "float32"))
        return model_s, fp32_s

    def kernel(self, in_features: int, out_features: int, dtype: torch.dtype) -> str:
        """ "baton" or "onednn": the GEMM an (in, out) linear computing in `dtype` runs on."""
        if self.gemm == "onednn" or not cpu_gemm.supports(dtype):
            return "onednn"
        if self.gemm == "baton":
            return "baton"
        key = (in_features, out_features, dtype)
        if key not in self.kernels:
            name = f"gemm {str(dtype).removeprefix('torch.')} {in_features}x{out_features}"
            onednn_s, baton_s = self._timed(
                name, lambda: self._time_gemms(in_features, out_features, dtype)
            )
            self.gemm_timings[key] = (onednn_s, baton_s)
            amx = cpu_gemm.has_amx() if self.amx is None else self.amx
            margin = AMX_GEMM_MARGIN if amx and dtype == torch.bfloat16 else BATON_GEMM_MARGIN
            self.kernels[key] = "baton" if baton_s < margin * onednn_s else "onednn"
        return self.kernels[key]

    def _time_gemms(
        self, in_features: int, out_features: int, dtype: torch.dtype
    ) -> tuple[float, float]:
        onednn_s = baton_s = float("inf")
        for _ in range(TIMING_ROUNDS):  # alternated, as for the dtype
            onednn_s = min(onednn_s, self.gemm_timer(in_features, out_features, dtype, "onednn"))
            baton_s = min(baton_s, self.gemm_timer(in_features, out_features, dtype, "baton"))
        return onednn_s, baton_s

    def plain_for_decode(
        self, in_features: int, out_features: int, dtype: torch.dtype, kernel: str
    ) -> bool:
        """Whether an (in, out) linear computing in `dtype` on `kernel` runs decode's rows (up
        to PLAIN_ROWS) faster as F.linear on a plain copy of its weight: timed for small
        weights only (a large one streams from memory, where the packed GEMMs win)."""
        if in_features * out_features > SMALL_WEIGHT:
            return False
        key = (in_features, out_features, dtype, kernel)
        if key not in self.plain_timings:
            name = (
                f"plain {str(dtype).removeprefix('torch.')} {kernel} {in_features}x{out_features}"
            )

            def time_both() -> tuple[float, float]:
                gemm_s = plain_s = float("inf")
                for _ in range(TIMING_ROUNDS):  # alternated, as for the dtype
                    gemm_s = min(gemm_s, self.decode_timer(*key, "gemm"))
                    plain_s = min(plain_s, self.decode_timer(*key, "plain"))
                return gemm_s, plain_s

            self.plain_timings[key] = self._timed(name, time_both)
        gemm_s, plain_s = self.plain_timings[key]
        return plain_s < PLAIN_MARGIN * gemm_s

    def summary(self) -> str:
        gemms = "; ".join(
            f"{i}x{o} {str(d).removeprefix('torch.')}: {self.kernels[(i, o, d)]} "
            f"({a * 1e3:.2f} ms onednn / {b * 1e3:.2f} ms baton)"
            for (i, o, d), (a, b) in self.gemm_timings.items()
        )
        plain = sum(1 for i, o, d, k in self.plain_timings if self.plain_for_decode(i, o, d, k))
        cached = f" ({self.num_cached} shapes on kept timings)" if self.num_cached else ""
        return (
            f"{self._dtype_summary()}; GEMM {self.gemm}: {gemms or 'not timed'}; decode rows on "
            f"a plain copy: {plain} of {len(self.plain_timings)} small shapes{cached}"
        )

    def _dtype_summary(self) -> str:
        if not self.timings:
            return f"{self.policy}: every matmul in {self.model_dtype}"
        parts = [
            f"{i}x{o}: {str(self.choices[(i, o)]).removeprefix('torch.')} "
            f"({m * 1e3:.2f} ms {str(self.model_dtype).removeprefix('torch.')} / "
            f"{f * 1e3:.2f} ms float32)"
            for (i, o), (m, f) in self.timings.items()
        ]
        return f"{self.policy}: " + "; ".join(parts)


_chooser: MatmulChooser | None = None


@contextlib.contextmanager
def matmul_dtypes(chooser: MatmulChooser | None) -> Iterator[MatmulChooser | None]:
    """PackedLinears built inside take their compute dtype from `chooser` (the layers that fuse
    their own projections build PackedLinear directly, so the choice reaches them this way)."""
    global _chooser
    previous, _chooser = _chooser, chooser
    try:
        yield chooser
    finally:
        _chooser = previous


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held only in its GEMM's packed layout (the plain copy is dropped).

    Inside `matmul_dtypes(chooser)`, W is packed in the dtype the chooser picks for its shape,
    for the GEMM it picks (oneDNN's blocked layout, or kernels/cpu_gemm's panels); when the dtype
    is float32 for a lower-precision model, the input is widened and the output narrowed back to
    the input's dtype. Outside, the weight's dtype on oneDNN."""

    def __init__(
        self,
        linear: nn.Linear,
        activation: str = "none",
        compute_dtype: torch.dtype | None = None,
        kernel: str | None = None,
    ):
        """activation: post-op fused into the matmul ("none" or "relu");
        compute_dtype: the weight's packed dtype (default: the chooser's, else the weight's);
        kernel: "onednn" or "baton" (default: the chooser's, else oneDNN)."""
        super().__init__()
        if activation not in ("none", "relu"):
            raise ValueError(f"unsupported fused activation {activation!r}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.activation = activation
        weight = linear.weight.detach()
        chooser = (
            _chooser if _chooser is not None and _chooser.model_dtype == weight.dtype else None
        )
        if compute_dtype is None:
            compute_dtype = (
                chooser(self.in_features, self.out_features) if chooser else weight.dtype
            )
        if kernel is None:
            kernel = (
                chooser.kernel(self.in_features, self.out_features, compute_dtype)
                if chooser
                else "onednn"
            )
        if kernel not in ("onednn", "baton"):
            raise ValueError(f"unknown GEMM {kernel!r}: expected onednn or baton")
        self.compute_dtype = compute_dtype
        self.kernel = kernel
        self.upcast = compute_dtype != weight.dtype
        # decode's rows on F.linear over a plain copy, where the chooser timed it faster
        plain = chooser is not None and chooser.plain_for_decode(
            self.in_features, self.out_features, compute_dtype, kernel
        )
        self.plain = weight.to(compute_dtype).contiguous() if plain else None
        bias = linear.bias
        if kernel == "baton":
            self.packed = cpu_gemm.pack(weight.to(compute_dtype))
            bias = None if bias is None else bias.detach().float().contiguous()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute_dtype), None)
            if bias is not None and self.upcast:
                bias = bias.detach().to(compute_dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # the plain path's bias in the compute dtype: the packed one's (no copy) unless baton's
        # GEMM keeps it float32
        self.plain_bias = (
            None
            if self.plain is None or self.bias is None
            else self.bias.detach().to(compute_dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.to(self.compute_dtype) if self.upcast else x
        if self.plain is not None and inputs.numel() <= PLAIN_ROWS * self.in_features:
            y = torch.nn.functional.linear(inputs, self.plain, self.plain_bias)
            if self.activation == "relu":
                y = torch.relu_(y)
        elif self.kernel == "baton":
            y = cpu_gemm.linear(
                inputs, self.packed, self.out_features, self.bias, self.activation == "relu"
            )
        else:
            y = torch.ops.mkldnn._linear_pointwise(
                inputs, self.packed, self.bias, self.activation, [], ""
            )
        return y.to(x.dtype) if self.upcast else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"activation={self.activation}, packed {self.compute_dtype} for {self.kernel}"
            + (f", decode rows plain (<= {PLAIN_ROWS})" if self.plain is not None else "")
        )


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace each `nn.Linear` under `model` by a PackedLinear; returns how many were packed.
    Inside `matmul_dtypes(chooser)` a linear is packed when its chosen dtype packs (an fp16
    model's linears pack where float32 is chosen; the rest stay `nn.Linear`)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    packed = 0
    for parent, name, child in targets:
        compute = child.weight.dtype
        if _chooser is not None and _chooser.model_dtype == compute:
            compute = _chooser(child.in_features, child.out_features)
        if can_pack(compute):
            setattr(parent, name, PackedLinear(child, compute_dtype=compute))
            packed += 1
    return packed


def matmul_params(model: nn.Module) -> int:
    """Weights that take part in a matmul per token (linear layers, packed or not)."""
    return sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, (nn.Linear, PackedLinear))
    )
