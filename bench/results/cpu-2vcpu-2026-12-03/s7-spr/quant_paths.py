"""Quantized linears on a bf16 model's rows: AMX tiles vs the register kernels, 110M shapes,
cold weights (copies filling ~256 MB), the two paths alternated, best of 5 rounds. From the
repository root: `python bench/results/cpu-2vcpu-2026-12-03/s7-spr/quant_paths.py
nvfp4,fp8,fp8_block 1,2,4,8,16,32,64,256,2048` (fp8: a scale per column; fp8_block: per 128
inputs; codes from Gaussian weights, so e4m3 subnormals are as rare as in a checkpoint)."""

import sys
import time

import torch

sys.path.insert(0, ".")
from baton.kernels.cpu import quant as cpu_quant
from baton.kernels.quant import QuantizedTensor

SHAPES = [(768, 5144), (1536, 768), (768, 2048), (2048, 768)]


def weight(fmt, n, k, g):
    if fmt == "nvfp4":
        data = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(0x20, 0x50, (n, k // 16), generator=g, dtype=torch.uint8)
        return QuantizedTensor(
            "nvfp4", data, scale.view(torch.float8_e4m3fn), torch.rand(n, generator=g), 16
        )
    group = 128 if fmt == "fp8_block" else k
    w = torch.randn(n, k, generator=g)
    amax = w.abs().view(n, -1, group).amax(-1) if k % group == 0 else w.abs().amax(-1, keepdim=True)
    scale = amax / 448
    codes = (w / scale.repeat_interleave(group, -1)[:, :k]).to(torch.float8_e4m3fn)
    return QuantizedTensor("fp8", codes, scale, None, group)


def run(fmt, rows_list):
    g = torch.Generator().manual_seed(0)
    packs = []
    for k, n in SHAPES:
        p = cpu_quant.pack(weight(fmt, n, k, g))
        packs.append(
            (
                k,
                [p]
                + [
                    p._replace(codes=p.codes.clone(), scales=p.scales.clone())
                    for _ in range(max(1, int(64e6 // p.nbytes())))
                ],
            )
        )
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k, _ in packs}
        best = {"registers": float("inf"), "amx": float("inf")}
        for _ in range(5):
            for path in ("registers", "amx"):
                cpu_quant.amx_from_rows(1 if path == "amx" else 0)
                start = time.perf_counter()
                calls = 0
                for k, copies in packs:
                    for p in copies:
                        cpu_quant.linear(xs[k], p)
                        calls += 1
                best[path] = min(best[path], (time.perf_counter() - start) / calls * 1e3)
        cpu_quant.amx_from_rows(cpu_quant.AMX_MIN_ROWS)
        print(
            f"{fmt:9s} rows {rows:5d}: registers {best['registers']:.3f} ms/call, amx {best['amx']:.3f}, registers/amx x{best['registers'] / best['amx']:.2f}",
            flush=True,
        )


for fmt in sys.argv[1].split(","):
    run(fmt, [int(r) for r in sys.argv[2].split(",")])
