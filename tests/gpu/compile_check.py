"""Compile every Triton kernel for a CUDA target on a machine without a GPU.

The interpreter accepts what a GPU build rejects (tl.dot under 16, mixed types, bad layouts), so
this sends every kernel through Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin
with the bundled ptxas) at Nemotron-Nano-9B-v2 shapes and at tiny odd ones, launching nothing: a
stub driver names the target and every launch becomes a warmup (compile only).

    TRITON_INTERPRET=0 .venv/bin/python -m tests.gpu.compile_check [--arch 90] [-v] [--jobs N]

The work is split into tasks (three shape sets x four kernel groups) shared by --jobs processes
(default: one per core).

-v prints registers, spill stores and shared memory per compiled variant (ptxas -v): the numbers
behind the hand-picked tiles in kernels/triton_*.py. Exit status 1 if a kernel failed to compile
or was never reached. tests/test_kernels_triton.py runs this in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before any kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

KERNEL_MODULES = (
    "baton.kernels.triton.ssd",
    "baton.kernels.triton.conv1d",
    "baton.kernels.triton.ssu",
    "baton.kernels.triton.attention",
    "baton.kernels.triton.state_copy",
    "baton.kernels.triton.norm",
    "baton.kernels.triton.gated_delta",
    "baton.kernels.triton.selective_scan",
    "baton.kernels.triton.quant",
    "baton.kernels.triton.moe",
    "baton.kernels.triton.lora",
    "baton.kernels.triton.kda",
    "baton.kernels.triton.lightning",
    "baton.kernels.triton.rglru",
)


class StubDriver:
    """Just enough of a Triton driver to compile: a device, a stream, a target."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def run_mamba2_attention_launchers(dtype: torch.dtype, dims: dict) -> None:
    """Call every Mamba2, attention, norm and state-copy launcher once on CPU tensors (only their
    shapes, strides and dtypes matter)."""
    from baton.kernels.attention import build_attention_layout
    from baton.kernels.conv1d import build_window_layout
    from baton.kernels.ssd import build_chunk_layout
    from baton.kernels.triton.attention import paged_attention_triton, rotary_store_kv_triton
    from baton.kernels.triton.conv1d import causal_conv1d_update_triton, causal_conv1d_varlen_triton
    from baton.kernels.triton.norm import gated_rms_norm_triton, rms_norm_triton
    from baton.kernels.triton.ssd import ssd_scan_triton
    from baton.kernels.triton.ssu import (
        selective_state_update_multi_triton,
        selective_state_update_triton,
    )
    from baton.kernels.triton.state_copy import copy_states_triton

    H, P, G, N, L = dims["H"], dims["P"], dims["G"], dims["N"], dims["chunk"]
    T, seq_lens = sum(SEQ_LENS), SEQ_LENS
    x = torch.randn(T, H, P).to(dtype)
    dt, B, C = torch.randn(T, H).to(dtype), torch.randn(T, G, N).to(dtype), torch.randn(T, G, N)
    A, D, dt_bias = torch.randn(H), torch.randn(H), torch.randn(H)
    init = torch.randn(2, H, P, N)
    layout = build_chunk_layout(seq_lens, [5, 0], L, "cpu")
    ssd_scan_triton(x, dt, A, B, C.to(dtype), D, dt_bias, init, layout)
    ssd_scan_triton(x, dt, A, B, C.to(dtype), D, dt_bias, init, layout, (0.0, 0.1))
    pool = torch.randn(5, H, P, N)
    rows = torch.tensor([1, 2, 0])
    selective_state_update_triton(pool, x[:3], dt[:3], A, B[:3], C[:3], D, dt_bias, rows)
    selective_state_update_multi_triton(
        pool, x[:4].view(2, 2, H, P), dt[:4].view(2, 2, H), A, B[:4].view(2, 2, G, N),
        C[:4].view(2, 2, G, N), D, dt_bias, torch.tensor([[1, 2, 3], [0, 0, 0]]),
    )  # fmt: skip
    conv, K = dims["conv"], dims["K"]
    xc, w, b = torch.randn(T, conv).to(dtype), torch.randn(conv, K).to(dtype), torch.randn(conv)
    conv_pool = torch.randn(4, conv, K - 1).to(dtype)
    window_layout = build_window_layout(seq_lens, K, "cpu")
    slots = torch.tensor([1, 2])
    causal_conv1d_varlen_triton(xc, w, b, conv_pool, slots, window_layout, torch.tensor([3, 35]))
    causal_conv1d_update_triton(xc[:3], w, None, conv_pool, rows)
    QH, KVH, Dh = dims["q_heads"], dims["kv_heads"], dims["head_dim"]
    k_cache, v_cache = torch.randn(400, KVH, Dh).to(dtype), torch.randn(400, KVH, Dh).to(dtype)
    q = torch.randn(T, QH, Dh).to(dtype)
    kv_indices = torch.arange(16, 216).view(2, 100)
    decode = build_attention_layout([1, 1], [100, 50], kv_indices, "cpu")
    paged_attention_triton(q[:2], k_cache, v_cache, decode, 0.1)
    paged_attention_triton(q[:2], k_cache, v_cache, decode, 0.1, num_splits=4)
    extend = build_attention_layout(seq_lens, [100, 50], kv_indices, "cpu")
    paged_attention_triton(q, k_cache, v_cache, extend, 0.1)
    k_new, v_new = torch.randn(T, KVH, Dh).to(dtype), torch.randn(T, KVH, Dh).to(dtype)
    token_slots = torch.arange(100, 100 + T)
    for rotary_dim in (Dh, Dh // 2):  # whole-head and partial rotary
        cos, sin = torch.randn(T, rotary_dim // 2), torch.randn(T, rotary_dim // 2)
        rotary_store_kv_triton(q, k_new, v_new, cos, sin, k_cache, v_cache, token_slots)
    hidden, inter = dims["hidden"], H * P
    rms_norm_triton(torch.randn(3, hidden).to(dtype), torch.randn(hidden).to(dtype), 1e-5)
    y, z = torch.randn(3, inter).to(dtype), torch.randn(3, inter).to(dtype)
    gated_rms_norm_triton(y, z, torch.randn(inter).to(dtype), 1e-5, inter // G)
    copy_states_triton(pool, torch.tensor([3]), pool, torch.tensor([1]))
    copy_states_triton(conv_pool, torch.tensor([3]), conv_pool, torch.tensor([1]))


def run_quantized_launchers(dtype: torch.dtype, dims: dict) -> None:
    """The quantized linears (w8a8 with its row quantizer, weight-only FP8 and NVFP4) and the
    fused MoE on plain and quantized experts."""
    from baton.kernels.layouts import Routing
    from baton.kernels.quant import QuantizedTensor
    from baton.kernels.triton.moe import fused_moe_triton
    from baton.kernels.triton.quant import quantize_rows_fp8_triton, w8a8_matmul, weight_only_matmul

    k = -(-dims["hidden"] // 32) * 32  # NVFP4 groups of 16, w8a8 tiles of 32
    n = 2 * k
    e4m3 = torch.float8_e4m3fn
    fp8 = QuantizedTensor("fp8", torch.zeros(n, k, dtype=e4m3), torch.ones(n, 1), None, k)
    block = fp8._replace(scale=torch.ones(n, -(-k // 32)), group=32)
    nvfp4 = QuantizedTensor(
        "nvfp4", torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 16).to(e4m3),
        torch.ones(n), 16,
    )  # fmt: skip
    for rows in (3, 40):  # decode-sized and prefill-sized tiles
        x = torch.randn(rows, k).to(dtype)
        codes, row_scale = quantize_rows_fp8_triton(x)
        w8a8_matmul(codes, row_scale, fp8, torch.zeros(n), dtype)
        w8a8_matmul(codes, row_scale, block, None, dtype)
        for weights in (fp8, block, nvfp4):
            weight_only_matmul(x, weights, None)
    experts, inter, T = 4, k // 2, 6
    routing = Routing(torch.rand(T, 2), torch.randint(0, experts, (T, 2)))
    x = torch.randn(T, k).to(dtype)
    for activation, up_rows in (("relu2", inter), ("swiglu", 2 * inter)):
        up = torch.randn(experts, up_rows, k).to(dtype)
        fused_moe_triton(x, up, torch.randn(experts, k, inter).to(dtype), routing, activation)

    def stack(q: QuantizedTensor, rows: int, cols: int) -> QuantizedTensor:
        width = cols // 2 if q.format == "nvfp4" else cols
        groups = cols // 16 if q.format == "nvfp4" else 1
        return QuantizedTensor(
            q.format, torch.zeros(experts, rows, width, dtype=q.data.dtype),
            torch.ones(experts, rows, groups).to(q.scale.dtype),
            None if q.global_scale is None else torch.ones(experts, rows), q.group if q.format == "nvfp4" else cols,
        )  # fmt: skip

    for q in (fp8, nvfp4):
        up, down = stack(q, 2 * inter, k), stack(q, k, inter)
        fused_moe_triton(x, up, down, routing, "swiglu")


def run_mamba1_launchers(dtype: torch.dtype, dims: dict) -> None:
    """The Mamba1 scan and decode step (d_inner = the conv width, d_state = N), gated and not,
    and LFM2's short conv (no activation, no bias)."""
    from baton.kernels.conv1d import build_window_layout
    from baton.kernels.ssd import build_chunk_layout
    from baton.kernels.triton.conv1d import causal_conv1d_update_triton, causal_conv1d_varlen_triton
    from baton.kernels.triton.selective_scan import (
        selective_scan_pool_triton,
        selective_state_update_triton,
    )

    width, N, K = dims["conv"], dims["N"], dims["K"]
    layout = build_chunk_layout(SEQ_LENS, [5, 0], dims["chunk"], "cpu")
    window_layout = build_window_layout(SEQ_LENS, K, "cpu")
    T = sum(SEQ_LENS)
    x, dt, z = (torch.randn(T, width).to(dtype) for _ in range(3))
    B, C = torch.randn(T, N).to(dtype), torch.randn(T, N).to(dtype)
    A, D, bias = -torch.rand(width, N), torch.randn(width), torch.randn(width)
    pool, slots = torch.randn(4, width, N), torch.tensor([1, 2])
    for gate, chunks in ((z, True), (None, False)):
        selective_scan_pool_triton(x, dt, A, B, C, D, bias, gate, pool, slots, layout, chunks)
        selective_state_update_triton(
            pool, x[:3], dt[:3], A, B[:3], C[:3], D, bias, gate[:3] if gate is not None else None,
            torch.tensor([1, 2, 0]),
        )  # fmt: skip
    w, conv_pool = torch.randn(width, K).to(dtype), torch.randn(4, width, K - 1).to(dtype)
    causal_conv1d_varlen_triton(x, w, None, conv_pool, slots, window_layout, None, "none")
    causal_conv1d_update_triton(x[:3], w, None, conv_pool, torch.tensor([1, 2, 0]), "none")


def run_gated_delta_launchers(dtype: torch.dtype, dims: dict) -> None:
    from baton.kernels.ssd import build_chunk_layout
    from baton.kernels.triton.gated_delta import (
        chunk_gated_delta_rule_triton,
        gated_delta_decode_triton,
    )

    gdn, seq_lens = dims["gdn"], SEQ_LENS
    Hk, Hv, dk, dv = gdn["Hk"], gdn["Hv"], gdn["dk"], gdn["dv"]
    T = sum(seq_lens)
    q, k = torch.randn(T, Hk, dk).to(dtype), torch.randn(T, Hk, dk).to(dtype)
    v = torch.randn(T, Hv, dv).to(dtype)
    g, beta = -torch.rand(T, Hv), torch.rand(T, Hv).to(dtype)
    layout = build_chunk_layout(seq_lens, [5, 0], gdn["chunk"], "cpu")
    chunk_gated_delta_rule_triton(q, k, v, g, beta, torch.randn(2, Hv, dk, dv), layout)
    pool = torch.randn(4, Hv, dk, dv)
    gated_delta_decode_triton(q[:3], k[:3], v[:3], g[:3], beta[:3], pool, torch.tensor([1, 0, 2]))


def run_lora_launchers(dtype: torch.dtype, dims: dict) -> None:
    """The batched LoRA shrink (one part and a fused projection's three) and expand into a column
    range of a wider output, at rank 16 and at an odd rank (padded), per row (a decode batch)
    and grouped by slot with tl.dot (a prefill's 70 rows)."""
    from baton.kernels.triton.lora import lora_expand_triton, lora_shrink_triton

    hidden, n = dims["hidden"], dims["conv"]
    for slots in (torch.tensor([0, -1, 1, 1, 0]), torch.tensor([0] * 30 + [-1] * 20 + [1] * 20)):
        x = torch.randn(len(slots), hidden).to(dtype)
        for rank in (16, 5):
            for parts in (1, 3):
                a_rows = torch.randn(parts * 2 * rank, hidden).to(dtype)
                low = lora_shrink_triton(x, a_rows, slots, rank, parts)
            out = torch.randn(len(slots), 2 * n).to(dtype)
            b_rows = torch.randn(2 * rank, n).to(dtype)
            lora_expand_triton(low[:, rank : 2 * rank], b_rows, slots, rank, out[:, n:])


def run_recurrence_launchers(dtype: torch.dtype, dims: dict) -> None:
    """Call the KDA, lightning attention and RG-LRU launchers once each: prefill on pool slots
    with chunk-end states, and decode with a padding row."""
    from baton.kernels.ssd import build_chunk_layout
    from baton.kernels.triton.kda import kda_decode_triton, kda_prefill_triton
    from baton.kernels.triton.lightning import (
        lightning_decode_triton,
        lightning_prefill_pool_triton,
    )
    from baton.kernels.triton.rglru import rglru_scan_pool_triton, rglru_update_triton

    rec = dims["recurrent"]
    T = sum(SEQ_LENS)
    layout = build_chunk_layout(SEQ_LENS, [5, 0], rec["chunk"], "cpu")
    slots, rows = torch.tensor([1, 2]), torch.tensor([1, 0, 2])
    H, dk, dv = rec["kda"]
    q, k, v = (torch.randn(T, H, d).to(dtype) for d in (dk, dk, dv))
    g, beta = -torch.rand(T, H, dk), torch.rand(T, H).to(dtype)
    pool = torch.randn(3, H, dk, dv)
    kda_prefill_triton(q, k, v, g, beta, pool, slots, layout)
    kda_decode_triton(q[:3], k[:3], v[:3], g[:3], beta[:3], pool, rows)
    H, d = rec["lightning"]
    q, k, v = (torch.randn(T, H, d).to(dtype) for _ in range(3))
    decay, pool = torch.rand(H), torch.randn(3, H, d, d)
    lightning_prefill_pool_triton(q, k, v, decay, pool, slots, layout)
    lightning_decode_triton(q[:3], k[:3], v[:3], decay, pool, rows)
    width = rec["rglru"]
    a, u, pool = torch.rand(T, width), torch.randn(T, width).to(dtype), torch.randn(3, width)
    rglru_scan_pool_triton(a, u, pool, slots, layout)
    rglru_update_triton(a[:3], u[:3], pool, rows)


SEQ_LENS = [30, 10]  # a varlen batch: one sequence over several chunks, one in a single chunk
# gdn: a gated DeltaNet layer's shapes (at full size, Qwen3-Next's); recurrent: KDA (heads, dk, dv),
# lightning (heads, head_dim) and RG-LRU width (at full size, Kimi Linear's, MiniMax-Text-01's and
# RecurrentGemma-2B's)
NANO_9B_V2 = dict(H=128, P=80, G=8, N=128, chunk=128, conv=12288, K=4, q_heads=40, kv_heads=8,
                  head_dim=128, hidden=4480, gdn=dict(Hk=16, Hv=32, dk=128, dv=128, chunk=64),
                  recurrent=dict(kda=(32, 128, 128), lightning=(64, 128), rglru=2560, chunk=64))  # fmt: skip
TINY = dict(H=4, P=16, G=2, N=8, chunk=16, conv=96, K=4, q_heads=4, kv_heads=2, head_dim=16,
            hidden=64, gdn=dict(Hk=2, Hv=4, dk=16, dv=16, chunk=16),
            recurrent=dict(kda=(2, 16, 16), lightning=(2, 16), rglru=64, chunk=16))  # fmt: skip
ODD = dict(H=6, P=12, G=3, N=5, chunk=8, conv=102, K=3, q_heads=5, kv_heads=1, head_dim=8,
           hidden=40, gdn=dict(Hk=1, Hv=3, dk=12, dv=20, chunk=8),
           recurrent=dict(kda=(3, 12, 40), lightning=(3, 12), rglru=1100, chunk=8))  # fmt: skip


SHAPES = {"nano_9b_v2": (torch.bfloat16, NANO_9B_V2), "tiny": (torch.float32, TINY),
          "odd": (torch.float16, ODD)}  # fmt: skip
GROUPS = {
    "mamba2_attention": run_mamba2_attention_launchers,
    "gated_delta": run_gated_delta_launchers,
    "mamba1": run_mamba1_launchers,
    "quantized": run_quantized_launchers,
    "lora": run_lora_launchers,
    "recurrences": run_recurrence_launchers,
}
# Every (shapes, group) pair is one task; `--part i/n` runs tasks[i::n], so n processes share the
# compiles (Triton's pipeline is single-threaded: one process per core is ~n times faster).
TASKS = [(shapes, group) for shapes in SHAPES for group in GROUPS]


def ptxas_report(kernel, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else
               f"--gpu-name=sm_{arch}", f.name, "-o", os.devnull]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return (f"registers {regs.group(1) if regs else '?'}, spill stores "
            f"{spills.group(1) if spills else '?'} B")  # fmt: skip


def expected_kernels() -> set[str]:
    import importlib

    modules = [importlib.import_module(name) for name in KERNEL_MODULES]
    return {
        name for module in modules for name, obj in vars(module).items()
        if isinstance(obj, JITFunction) and name.endswith("_kernel")
    }  # fmt: skip


def compile_tasks(tasks: list[tuple[str, str]], arch: int, verbose: bool) -> list[str]:
    """Compile the tasks' kernels here; one printed line per compiled variant, name first."""
    compiled: list[tuple[str, object]] = []
    original_run = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        kernel = original_run(self, *a, grid=grid, warmup=True, **kw)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    driver.set_active(StubDriver(arch))
    JITFunction.run = compile_only
    try:
        for shapes, group in tasks:
            dtype, dims = SHAPES[shapes]
            GROUPS[group](dtype, dims)
    finally:
        JITFunction.run = original_run  # the stub driver stays: this process only compiles
    lines = []
    for name, kernel in compiled:
        line = f"{name:<26} warps {kernel.metadata.num_warps}, smem {kernel.metadata.shared} B"
        lines.append(line + (f", {ptxas_report(kernel, arch)}" if verbose else ""))
    return lines


def compile_in_processes(jobs: int, arch: int, verbose: bool) -> list[str]:
    """Each of `jobs` fresh processes compiles its share of the tasks (--part i/jobs)."""
    command = [sys.executable, "-m", "tests.gpu.compile_check", "--arch", str(arch)]
    command += ["-v"] if verbose else []
    parts = [
        subprocess.Popen(command + ["--part", f"{i}/{jobs}"], stdout=subprocess.PIPE, text=True)
        for i in range(jobs)
    ]
    lines = []
    for part in parts:
        out, _ = part.communicate()
        if part.returncode != 0:
            raise RuntimeError(f"compile_check part failed (exit {part.returncode}):\n{out}")
        lines += out.splitlines()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="ptxas registers and spills")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes compiling at once"
    )
    parser.add_argument("--part", help="i/n: compile only tasks[i::n] here (used by --jobs)")
    args = parser.parse_args(argv)

    expected = expected_kernels()
    if not expected:
        print(
            "compile_check: the kernels were imported in interpreter mode; run in a fresh process"
        )
        return 1
    if args.part:
        index, count = (int(v) for v in args.part.split("/"))
        print("\n".join(compile_tasks(TASKS[index::count], args.arch, args.verbose)))
        return 0
    jobs = max(1, min(args.jobs, len(TASKS)))
    if jobs == 1:
        lines = compile_tasks(TASKS, args.arch, args.verbose)
    else:
        lines = compile_in_processes(jobs, args.arch, args.verbose)
    print("\n".join(lines))
    missing = expected - {line.split()[0] for line in lines if line.strip()}
    if missing:
        print(f"compile_check: never compiled: {sorted(missing)}")
        return 1
    print(f"compile_check: {len(lines)} variants of {len(expected)} kernels compiled for "
          f"sm_{args.arch} (triton {triton.__version__}, {jobs} processes)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
