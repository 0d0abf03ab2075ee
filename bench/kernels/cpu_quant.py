"""The weight-only quantized CPU linear (kernels/cpu/quant.c) on a model's whole sequence of
linears, each weight read cold as a decode step reads it: GB/s of packed weight bytes (codes and
scales) per call at a few row counts, FP8 and NVFP4, beside this machine's read bandwidth (a
float32 sum over 1 GiB) and bf16 `F.linear` on the same shapes. Alternated rounds in one process;
prints the best round of each. At one row the kernel should stream at the read bandwidth; the
byte-ratio bound of a quantized model's decode speed assumes it does.

    python -m baton.bench.kernels.cpu_quant --config 110m --rows 1,8,32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from baton.bench.kernels.cpu_gemm import linear_shapes
from baton.bench.workloads import CONFIGS
from baton.kernels.cpu import quant as cpu_quant
from baton.kernels.quant import QuantizedTensor


def random_weight(fmt: str, out_features: int, in_features: int) -> QuantizedTensor:
    """Random codes (no e4m3 NaN) with ordinary scales: the kernel's speed does not depend on
    the values."""
    if fmt == "nvfp4":
        data = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
        scale = torch.randint(0x30, 0x50, (out_features, in_features // 16), dtype=torch.uint8)
        return QuantizedTensor(
            "nvfp4", data, scale.view(torch.float8_e4m3fn), torch.rand(out_features), 16
        )
    codes = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scale = torch.rand(out_features, 1) * 0.01
    return QuantizedTensor("fp8", codes.view(torch.float8_e4m3fn), scale, None, in_features)


def run_sequence(name: str, weights: list, xs: dict[int, torch.Tensor]) -> None:
    """Every linear once, in forward order, on rows of its input width."""
    for w in weights:
        if name == "bf16":
            F.linear(xs[w.shape[1]], w)
        else:
            cpu_quant.linear(xs[w.in_features], w)


def read_bandwidth() -> float:
    """GB/s of the best of 5 float32 sums over 1 GiB."""
    big = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="110m", choices=sorted(CONFIGS))
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not cpu_quant.supported():
        raise SystemExit("no quantized CPU kernel here (needs AVX-512 or AVX2 + FMA)")
    shapes = [(i, o) for i, o in linear_shapes(args.config, "bfloat16") if i % 16 == 0]
    variants = {
        "bf16": [torch.randn(o, i).bfloat16() for i, o in shapes],
        **{
            fmt: [cpu_quant.pack(random_weight(fmt, o, i)) for i, o in shapes]
            for fmt in ("fp8", "nvfp4")
        },
    }
    nbytes = {
        "bf16": sum(w.numel() * 2 for w in variants["bf16"]),
        "fp8": sum(p.nbytes() for p in variants["fp8"]),
        "nvfp4": sum(p.nbytes() for p in variants["nvfp4"]),
    }
    print(
        f"{args.config}: {len(shapes)} linears, {torch.get_num_threads()} threads, "
        f"read bandwidth {read_bandwidth():.1f} GB/s"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {i: torch.randn(rows, i).bfloat16() for i, _ in shapes}
        best = {name: float("inf") for name in variants}
        for _ in range(args.rounds):
            for name, weights in variants.items():  # alternated: load bursts hit every variant
                start = time.perf_counter()
                run_sequence(name, weights, xs)
                best[name] = min(best[name], time.perf_counter() - start)
        line = "  ".join(
            f"{name} {best[name] * 1e3:7.2f} ms {nbytes[name] / best[name] / 1e9:5.1f} GB/s"
            for name in variants
        )
        print(f"  rows {rows:3}: {line}")


if __name__ == "__main__":
    main()
