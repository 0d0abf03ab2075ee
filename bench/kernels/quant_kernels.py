"""Quantized linears on a GPU: bf16 `torch.mm` against the Triton FP8 w8a8 GEMM (dynamic
per-token activation scales), FP8 weight-only and NVFP4 weight-only, at Nemotron-Nano-9B-v2's
linear shapes, rows 1..2048 (CUDA only; on a machine without CUDA it says so and exits 0).

    python -m baton.bench.kernels.quant_kernels [--json quant.json]

Per shape and row count: microseconds of each, its ratio to bf16 (> 1: faster), and the weight
bytes each reads per call over its time (decode-sized calls are bound by those bytes: FP8 reads
half of bf16's, NVFP4 a little over a quarter).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# (out, in) of Nemotron-Nano-9B-v2's in_proj, MLP up / down, attention q
SHAPES = ((22656, 4480), (15680, 4480), (4480, 15680), (5120, 4480))
ROWS = (1, 16, 128, 2048)


def time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def time_all(x: torch.Tensor, weight: torch.Tensor, fp8, nvfp4) -> dict[str, float]:
    from baton.kernels.triton.quant import quantize_rows_fp8_triton, w8a8_matmul, weight_only_matmul

    def w8a8() -> torch.Tensor:
        codes, scale = quantize_rows_fp8_triton(x)
        return w8a8_matmul(codes, scale, fp8, None, torch.bfloat16)

    return {
        "bf16": time_us(lambda: x @ weight.T),
        "fp8_w8a8": time_us(w8a8),
        "fp8_weight_only": time_us(lambda: weight_only_matmul(x, fp8, None)),
        "nvfp4_weight_only": time_us(lambda: weight_only_matmul(x, nvfp4, None)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("baton.bench.kernels.quant_kernels: no CUDA device, nothing to time")
        return 0
    from baton.kernels.quant import QuantizedTensor, quantize_fp8

    cuda = torch.device("cuda")
    results = []
    for n, k in SHAPES:
        weight = torch.randn(n, k, device=cuda, dtype=torch.bfloat16) * 0.02
        fp8 = quantize_fp8(weight)
        nvfp4 = QuantizedTensor(
            "nvfp4",
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=cuda),
            torch.ones(n, k // 16, device=cuda).to(torch.float8_e4m3fn),
            torch.full((n,), 1e-3, device=cuda),
            16,
        )
        for rows in ROWS:
            x = torch.randn(rows, k, device=cuda, dtype=torch.bfloat16)
            times = time_all(x, weight, fp8, nvfp4)
            bytes_read = {"bf16": 2 * n * k, "fp8_w8a8": n * k, "fp8_weight_only": n * k,
                          "nvfp4_weight_only": n * k // 2 + n * k // 16}  # fmt: skip
            row = {"out": n, "in": k, "rows": rows, "us": times}
            row["vs_bf16"] = {name: times["bf16"] / t for name, t in times.items()}
            row["weight_GBps"] = {name: bytes_read[name] / t / 1e3 for name, t in times.items()}
            results.append(row)
            print(
                f"{n}x{k} rows {rows:>4}: "
                + "  ".join(
                    f"{name} {t:8.1f} us (x{row['vs_bf16'][name]:.2f}, "
                    f"{row['weight_GBps'][name]:.0f} GB/s)"
                    for name, t in times.items()
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
