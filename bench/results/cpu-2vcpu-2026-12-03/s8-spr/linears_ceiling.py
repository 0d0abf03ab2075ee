"""The batch-1 ceiling of issue 41's target with no host time at all: one decode step's linears of
the 110M config (16 layers: 7 Mamba in/out projections, 7 MLP up/down, 2 attention qkv/o, the bf16
lm_head) at one row, bf16 vs FP8 vs NVFP4 weights, called back to back from Python with nothing
else in the step; copies of every weight cycle so each step reads them from memory (~3 steps'
worth per format, > the L2 of both cores), the formats alternated step-set by step-set and the
median kept. Ratio = bf16 time / format time, against the byte bound (bf16 bytes / format bytes).
From the repository root: `python bench/results/cpu-2vcpu-2026-12-03/s8-spr/linears_ceiling.py`."""

import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from baton.kernels.cpu import gemm as cpu_gemm  # noqa: E402
from baton.kernels.cpu import quant as cpu_quant
from baton.kernels.quant import QuantizedTensor  # noqa: E402

# (in, out, count per step) of the 110M NemotronH config's quantized linears
LINEARS = [
    (768, 5144, 7),
    (1536, 768, 7),
    (768, 2048, 7),
    (2048, 768, 7),
    (768, 1280, 2),
    (768, 768, 2),
]
LM_HEAD = (768, 32000)
COPIES = 3


def quantized(fmt, n, k, g):
    w = torch.randn(n, k, generator=g) * 0.02
    if fmt == "fp8":  # per-tensor scale, as ModelOpt FP8
        scale = w.abs().amax() / 448
        return QuantizedTensor(
            "fp8", (w / scale).to(torch.float8_e4m3fn), scale.view(1, 1), None, k
        )
    groups = w.view(n, k // 16, 16)
    global_scale = w.abs().amax() / (6 * 448)
    scale = (groups.abs().amax(-1) / 6 / global_scale).to(torch.float8_e4m3fn)
    values = groups / (scale.float() * global_scale)[..., None]
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    codes = (values.abs()[..., None] - grid).abs().argmin(-1) | ((values < 0).to(torch.int64) << 3)
    codes = codes.view(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | codes[:, 1::2] << 4
    return QuantizedTensor("nvfp4", packed, scale, torch.full((n,), float(global_scale)), 16)


def main():
    g = torch.Generator().manual_seed(0)
    head = [
        cpu_gemm.pack(torch.randn(LM_HEAD[1], LM_HEAD[0], generator=g).bfloat16())
        for _ in range(COPIES)
    ]
    steps, nbytes = {}, {}
    for fmt in ("bf16", *(sys.argv[1].split(",") if len(sys.argv) > 1 else ("fp8", "nvfp4"))):
        copies, total = [], LM_HEAD[0] * LM_HEAD[1] * 2
        for c in range(COPIES):
            calls = []
            for k, n, count in LINEARS:
                for _ in range(count):
                    if fmt == "bf16":
                        w = cpu_gemm.pack(torch.randn(n, k, generator=g).bfloat16())
                        calls.append(("bf16", w, n, k))
                        total += (n * k * 2) if c == 0 else 0
                    else:
                        p = cpu_quant.pack(quantized(fmt, n, k, g))
                        calls.append((fmt, p, n, k))
                        total += p.nbytes() if c == 0 else 0
            copies.append(calls)
        steps[fmt], nbytes[fmt] = copies, total
    xs = {k: torch.randn(1, k, generator=g).bfloat16() for k in {768, 1536, 2048}}

    def run_step(fmt, c):
        for kind, w, n, k in steps[fmt][c]:
            if kind == "bf16":
                cpu_gemm.linear(xs[k], w, n)
            else:
                cpu_quant.linear(xs[k], w)
        cpu_gemm.linear(xs[768], head[c], LM_HEAD[1])

    times = {fmt: [] for fmt in steps}
    for fmt in steps:  # warm-up
        for c in range(COPIES):
            run_step(fmt, c)
    for _ in range(15):
        for fmt in steps:
            start = time.perf_counter()
            for c in range(COPIES):
                run_step(fmt, c)
            times[fmt].append((time.perf_counter() - start) / COPIES)
    base = statistics.median(times["bf16"])
    for fmt in steps:
        t = statistics.median(times[fmt])
        paired = statistics.median(b / q for b, q in zip(times["bf16"], times[fmt]))
        bound = nbytes["bf16"] / nbytes[fmt]
        print(
            f"{fmt:>6}: {nbytes[fmt] / 1e6:6.1f} MB a step, {t * 1e3:6.2f} ms ({nbytes[fmt] / t / 1e9:5.1f} GB/s)"
            f" | x{base / t:.2f} of bf16 (paired x{paired:.2f}), bound x{bound:.2f}:"
            f" {base / t / bound:.0%} (paired {paired / bound:.0%})"
        )


if __name__ == "__main__":
    main()
