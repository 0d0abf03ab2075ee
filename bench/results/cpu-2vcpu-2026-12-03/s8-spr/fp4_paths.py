"""NVFP4 on a bf16 model's rows below AMX's rows: the VDPBF16PS kernels (`cpu_quant.fp4_dot(True)`)
vs the float32 kernels on widened rows (the default where the CPU has AMX), 110M shapes, cold
weights (copies filling ~60 MB per shape; `hot`: one copy), the two paths alternated 7 times and
the medians kept, with the median of each round's ratio. From the repository root:
`python bench/results/cpu-2vcpu-2026-12-03/s8-spr/fp4_paths.py [hot]`."""

import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from baton.kernels.cpu import quant as cpu_quant  # noqa: E402
from baton.kernels.quant import QuantizedTensor  # noqa: E402

SHAPES = [(768, 5144), (1536, 768), (768, 2048), (2048, 768)]


def nvfp4(n, k, g):
    data = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0x20, 0x50, (n, k // 16), generator=g, dtype=torch.uint8)
    return QuantizedTensor(
        "nvfp4", data, scale.view(torch.float8_e4m3fn), torch.rand(n, generator=g), 16
    )


def main():
    print("default: dot kernels" if cpu_quant.fp4_dot() else "default: float32 kernels")
    g = torch.Generator().manual_seed(0)
    hot = "hot" in sys.argv
    packs = []
    for k, n in SHAPES:
        w = cpu_quant.pack(nvfp4(n, k, g))
        copies = (
            []
            if hot
            else [
                w._replace(codes=w.codes.clone(), scales=w.scales.clone())
                for _ in range(int(60e6 // w.nbytes()))
            ]
        )
        packs.append((k, w.nbytes(), [w, *copies]))
    default = cpu_quant.fp4_dot()
    for rows in (1, 2, 3, 4, 6):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k, _ in SHAPES}
        rates = {True: [], False: []}
        for _ in range(7):
            for dot in (True, False):
                cpu_quant.fp4_dot(dot)
                start, total = time.perf_counter(), 0
                for k, nbytes, ws in packs:
                    for w in ws:
                        cpu_quant.linear(xs[k], w)
                        total += nbytes
                rates[dot].append(total / (time.perf_counter() - start) / 1e9)
        paired = statistics.median(f / d for d, f in zip(rates[True], rates[False]))
        print(
            f"rows {rows}: dot {statistics.median(rates[True]):.1f} GB/s, float32 "
            f"{statistics.median(rates[False]):.1f} GB/s, paired float32 / dot x{paired:.2f}"
        )
    cpu_quant.fp4_dot(default)


if __name__ == "__main__":
    main()
