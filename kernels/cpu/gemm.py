"""The CPU linears' own GEMM (kernels/cpu/gemm.c): AVX-512 float32 and AVX512-BF16 bfloat16,
weights packed once into column panels, the next panel prefetched while one runs.

oneDNN's prepacked linear is near the machine's peak for prefill-sized row counts but not for
decode's few rows over weights far larger than the caches: on the 110M model's decode sequence
at 32 rows it reaches ~65% of the bf16 peak (the panels it reads on demand from memory leave the
FMA units waiting); this kernel, ~88% (bf16) and ~95% of the fp32 peak (float32). Which one a
linear runs is timed per shape at load (kernels/linear.py `MatmulChooser.kernel`): a CPU where
oneDNN is faster (AMX) keeps oneDNN. Built and cached like kernels/cpu/ops.py; a CPU without
AVX-512 (or AVX512-BF16, for bfloat16), no compiler, a failed build or `BATON_CPU_OPS=0` leave
oneDNN. Accumulation is float32, as oneDNN's; results agree to float32 rounding
(tests/test_cpu_gemm.py).

Shapes: x (..., K) float32 or bfloat16, rows may be strided; packed from `pack(weight (N, K))`;
bias (N,) float32 or None; returns (..., N) in x's dtype.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library

SOURCE = Path(__file__).with_name("gemm.c")
BLOCK = 16  # output columns per packed block; must match cpu/gemm.c
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # cpu/gemm.c's DTYPE_F32 / DTYPE_BF16
AMX_MIN_ROWS = 8  # cpu/gemm.c's amx_min_rows at load


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: CPU linears run on oneDNN."""
    return cpu_library()


def amx_from_rows(rows: int) -> bool:
    """bfloat16 calls of `rows` rows and more run on AMX (rows < 1: none do; the default is
    AMX_MIN_ROWS); returns whether this build and process run AMX at all (Linux grants the tile
    state per process; a CPU or compiler without AMX: never)."""
    lib = library()
    return lib is not None and bool(lib.baton_gemm_amx(rows))


@functools.cache
def has_amx() -> bool:
    """Whether this machine's build runs bfloat16 on AMX (from AMX_MIN_ROWS rows)."""
    return supports(torch.bfloat16) and amx_from_rows(AMX_MIN_ROWS)


def supports(dtype: torch.dtype) -> bool:
    """Whether this machine's build runs `dtype` (AVX-512 for float32, AVX512-BF16 for bf16)."""
    lib = library()
    code = DTYPE_CODES.get(dtype)
    return lib is not None and code is not None and bool(lib.baton_gemm_supported() >> code & 1)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) weight -> the kernel's panels, a flat tensor in the weight's dtype: 16 output
    columns per block (the last padded with zero rows); float32 as [N/16][K][16], bfloat16 as
    [N/16][K/2][16][2] (k pairs interleaved, K padded with a zero column when odd)."""
    if weight.dtype not in DTYPE_CODES or weight.dim() != 2:
        raise ValueError(f"cpu_gemm packs 2-D float32/bfloat16 weights, not {weight.dtype}")
    n, k = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    weight = weight.detach()
    if k % pair:
        weight = F.pad(weight, (0, 1))  # a zero column (bf16 with odd K only)
    pairs, blocks, full = weight.shape[1] // pair, -(-n // BLOCK), n // BLOCK
    # One pass from the weight into its panels (a padded copy first, then the panel copy, was
    # two: a 110M model's packing took twice as long, and its peak held three copies)
    out = weight.new_empty(blocks, pairs, BLOCK, pair)
    panels = out.permute(0, 2, 1, 3)  # (blocks, BLOCK, pairs, pair): rows in weight order
    panels[:full].copy_(weight[: full * BLOCK].reshape(full, BLOCK, pairs, pair))
    if full < blocks:  # the last block's missing rows are zeros
        panels[full].zero_()
        panels[full, : n - full * BLOCK].copy_(weight[full * BLOCK :].reshape(-1, pairs, pair))
    return out.view(-1)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """`x @ W.T (+ bias) (relu)` for `packed = pack(W)`; x in the packed weight's dtype."""
    lib = library()
    code = DTYPE_CODES.get(x.dtype)
    if lib is None or code is None or x.dtype != packed.dtype:
        raise ValueError(f"cpu_gemm: x {x.dtype} with weights packed in {packed.dtype}")
    k = x.shape[-1]
    pair = 2 if x.dtype == torch.bfloat16 else 1
    if packed.numel() != -(-out_features // BLOCK) * BLOCK * -(-k // pair) * pair:
        raise ValueError(f"cpu_gemm: packed weights are not ({out_features}, {k})")
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # a decode step's rows: no reshape
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    if m == 0:
        return y
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("cpu_gemm: the bias is a contiguous float32 vector")
    status = lib.baton_gemm(
        code,
        rows,
        m,
        k,
        rows.stride(0),
        packed,
        out_features,
        bias,
        int(relu),
        y,
        out_features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"cpu_gemm: this build does not run {x.dtype}")
    return y
