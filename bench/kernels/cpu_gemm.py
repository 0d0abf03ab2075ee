"""baton's CPU GEMM (kernels/cpu/gemm.c) against oneDNN's prepacked linear on a model's whole
sequence of linears, in the order a forward runs them, so that each weight is read cold as a
decode step reads it (the 110M model's 171 MB of bf16 weights are five times the L3 cache).
Alternated rounds in one process; prints the best round of each, the FLOP rate as a fraction of
the 2048^3 matmul peak measured in the same run, and the baton / oneDNN speed ratio.

    python -m baton.bench.kernels.cpu_gemm --config 110m --dtype bfloat16 --rows 1,8,32,64,256
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from baton.bench.offline.flop_rates import mm_peaks
from baton.bench.workloads import CONFIGS, save_model
from baton.kernels.cpu import gemm as cpu_gemm
from baton.kernels.linear import PackedLinear, _packed_mm


def linear_shapes(config: str, dtype: str) -> list[tuple[int, int]]:
    """(in, out) of every packed linear of the config's model, in forward order."""
    from baton import LLM

    with tempfile.TemporaryDirectory() as d:
        save_model(config, d)
        llm = LLM(d, dtype=dtype, max_running_requests=4)
        return [
            (m.in_features, m.out_features)
            for m in llm.engine.model.modules()
            if isinstance(m, PackedLinear)
        ]


def bench(shapes, dtype: torch.dtype, rows: int, rounds: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for i, o in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    baton = [cpu_gemm.pack(w) for w in weights]
    inputs = {i: torch.randn(rows, i, generator=g).to(dtype) for i, _ in shapes}

    def run_onednn():
        for (i, _), w in zip(shapes, onednn):
            _packed_mm(inputs[i], w)

    def run_baton():
        for (i, o), w in zip(shapes, baton):
            cpu_gemm.linear(inputs[i], w, o)

    fns = {"onednn": run_onednn, "baton": run_baton}
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # oneDNN builds its kernels on the first call
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="110m", choices=sorted(CONFIGS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,8,32,64,256", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not cpu_gemm.supports(dtype):
        print(f"baton's GEMM does not run {args.dtype} on this CPU (or BATON_CPU_OPS=0)")
        return 0
    shapes = linear_shapes(args.config, args.dtype)
    peak = max(mm_peaks(dtype).values())
    per_row = sum(2 * i * o for i, o in shapes)
    print(f"[{args.config} {args.dtype}] {len(shapes)} linears, peak {peak / 1e9:.0f} GFLOP/s")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        best = bench(shapes, dtype, rows, args.rounds)
        rate = {k: per_row * rows / v for k, v in best.items()}
        ratio = best["onednn"] / best["baton"]
        print(
            f"  rows {rows:4d}: oneDNN {best['onednn'] * 1e3:7.2f} ms "
            f"({rate['onednn'] / peak:5.1%} of peak), baton {best['baton'] * 1e3:7.2f} ms "
            f"({rate['baton'] / peak:5.1%}); baton / oneDNN speed {ratio:.2f}x"
        )
        results.append({"rows": rows, "seconds": best, "peak_fraction": {
            k: v / peak for k, v in rate.items()}, "speedup": ratio})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "dtype": args.dtype, "peak": peak,
                       "shapes": shapes, "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
