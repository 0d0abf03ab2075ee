"""The fused C prefill kernels (kernels/cpu/prefill.c) against the torch paths they replace, on
the side-by-side workload's prefill (32 prompts x 128 tokens) and a varlen batch, alternated
rounds in one process; prints best-of-rounds times and the C / torch ratio with the load average.

    python -m baton.bench.kernels.cpu_prefill --config 110m --rounds 5
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from baton.kernels.conv1d import build_window_layout, causal_conv1d_varlen_torch
from baton.kernels.cpu import prefill as cpu_prefill
from baton.kernels.norm import gated_rms_norm_torch
from baton.kernels.ssd import build_chunk_layout, discretize_dt, ssd_scan_torch

# (heads, head_dim, groups, d_state, chunk, conv kernel) of baton.bench.offline.run's configs
SHAPES = {"110m": (24, 64, 8, 128, 128, 4), "19m": (8, 32, 2, 64, 64, 4)}
BATCHES = {"side-by-side": [128] * 32, "varlen": [512, 40, 300, 33, 129, 77]}


def alternate(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: min(v) for k, v in times.items()}


def bench(config: str, batch: str, dtype: torch.dtype, rounds: int) -> list[dict]:
    H, P, G, N, L, K = SHAPES[config]
    lens = BATCHES[batch]
    S, T = len(lens), sum(lens)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, P, generator=g).to(dtype)
    dt = torch.randn(T, H, generator=g).to(dtype)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.2, torch.randn(H, generator=g), torch.zeros(H)
    B = torch.randn(T, G, N, generator=g).to(dtype)
    C = torch.randn(T, G, N, generator=g).to(dtype)
    pool = torch.randn(S, H, P, N, generator=g)
    slots = torch.arange(S)
    layout = build_chunk_layout(lens, [0] * S, L, "cpu")
    limit = (0.0, float("inf"))

    def torch_scan():
        out = ssd_scan_torch(x, dt, A, B, C, D, dt_bias, pool[slots], layout, limit)
        pool[slots] = out.final_states

    def c_scan():
        cpu_prefill.ssd_prefill_cpu(
            x, discretize_dt(dt, dt_bias, limit), A, B, C, D, pool, slots,
            layout.cu_seqlens, layout.start_pos, L, None,
        )  # fmt: skip

    dim = H * P + 2 * G * N
    xbc = torch.randn(T, dim + H * P, generator=g).to(dtype)[:, H * P :]
    weight, bias = torch.randn(dim, K).to(dtype), torch.randn(dim).to(dtype)
    conv_pool = torch.randn(S, dim, K - 1).to(dtype)
    window_layout = build_window_layout(lens, K, "cpu")
    y = torch.randn(T, H * P).to(dtype)
    z = torch.randn(T, 2 * H * P).to(dtype)[:, : H * P]
    norm_w = torch.rand(H * P).to(dtype)
    group = H * P // G
    pairs = {
        "ssd scan": (torch_scan, c_scan),
        "conv + silu": (
            lambda: causal_conv1d_varlen_torch(xbc, weight, bias, conv_pool, slots, window_layout),
            lambda: cpu_prefill.causal_conv1d_varlen_cpu(
                xbc, weight, bias, conv_pool, slots, window_layout
            ),
        ),
        "gate norm": (
            lambda: gated_rms_norm_torch(y, z, norm_w, 1e-5, group),
            lambda: cpu_prefill.gated_rms_norm_cpu(y, z, norm_w, 1e-5, group),
        ),
    }
    rows = []
    for name, (torch_fn, c_fn) in pairs.items():
        best = alternate({"torch": torch_fn, "c": c_fn}, rounds)
        rows.append(
            dict(
                config=config,
                batch=batch,
                dtype=str(dtype).removeprefix("torch."),
                kernel=name,
                torch_ms=best["torch"] * 1e3,
                c_ms=best["c"] * 1e3,
                ratio=best["c"] / best["torch"],
                load=os.getloadavg()[0],
            )
        )
        r = rows[-1]
        print(
            f"[{config} {batch} {r['dtype']}] {name}: torch {r['torch_ms']:.1f} ms, "
            f"C {r['c_ms']:.1f} ms, C/torch {r['ratio']:.2f} (load {r['load']:.1f})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "all"], default="all")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if cpu_prefill.library() is None:
        raise SystemExit("kernels/cpu/prefill.c did not build (no C compiler, or BATON_CPU_OPS=0)")
    for config in list(SHAPES) if args.config == "all" else [args.config]:
        for dtype in ["float32", "bfloat16"] if args.dtype == "all" else [args.dtype]:
            for batch in BATCHES:
                bench(config, batch, getattr(torch, dtype), args.rounds)


if __name__ == "__main__":
    main()
