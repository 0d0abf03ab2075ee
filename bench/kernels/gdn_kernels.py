"""The gated delta rule's fast paths against its torch path, in one process, same inputs.

    python -m baton.bench.kernels.gdn_kernels [--shapes qwen3-next|small] [--rounds 5] [--threads N] [--json f]

On the CPU: the C kernels (kernels/cpu/gated_delta.c) vs the torch path, alternated rounds,
best of rounds: prefill (one long prompt and a batch of short ones, chunk-end states kept),
the decode step at batches 1..32, and the fused decode step of a whole mixer (conv, gating, the
rule, the gated norm) vs the composite path it replaces. On a CUDA device (TRITON_INTERPRET
unset): the Triton kernels vs the torch path, timed by triton.testing.do_bench. Prints each
time and the torch / fast-path ratio, with the load average (the CPU figures move with it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from baton.kernels.cpu import gated_delta as cpu_gated_delta
from baton.kernels.gated_delta import (
    chunk_gated_delta_rule_torch,
    gated_delta_decode_torch,
    gdn_gating,
)
from baton.kernels.gdn_mixer import GDNMixerDims, GDNMixerWeights, gdn_mixer_decode
from baton.kernels.ssd import build_chunk_layout

# (num_k_heads, num_v_heads, k_head_dim, v_head_dim, chunk) of one GDN layer
SHAPES = {"qwen3-next": (16, 32, 128, 128, 64), "small": (4, 8, 64, 64, 64)}
PREFILLS = {"1 x 1024": [1024], "8 x 128": [128] * 8}
DECODE_BATCHES = (1, 8, 32)
CONV_K = 4


def best_of(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Alternate the functions round by round (load drifts hit both); best time in ms."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm up: builds, allocator, first-touch page faults
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: min(v) for k, v in times.items()}


def cuda_timer(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    import triton.testing

    return {k: triton.testing.do_bench(fn, warmup=10, rep=50) for k, fn in fns.items()}


def rule_inputs(T: int, shape, device, dtype):
    Hk, Hv, dk, dv, _ = shape
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, Hk, dk, generator=gen), torch.randn(T, Hk, dk, generator=gen)
    v = torch.randn(T, Hv, dv, generator=gen)
    a, b = torch.randn(T, Hv, generator=gen), torch.randn(T, Hv, generator=gen)
    A_log = torch.empty(Hv).uniform_(0.0, 2.7, generator=gen)
    g, beta = gdn_gating(a, b, A_log, torch.zeros(Hv), 1.0)
    return [t.to(device, dtype) for t in (q, k, v)] + [g.to(device), beta.to(device)]


def torch_prefill(q, k, v, g, beta, pool, slots, layout) -> None:
    """The torch path with its pool gather and scatter, as baton.kernels.gated_delta does it."""
    out = chunk_gated_delta_rule_torch(q, k, v, g, beta, pool[slots], layout)
    pool[slots] = out.final_states


def bench_rule(shape, device, dtype, rounds: int, timer) -> list[dict]:
    Hk, Hv, dk, dv, chunk = shape
    if device.type == "cuda":
        from baton.kernels.triton.gated_delta import (
            chunk_gated_delta_rule_triton,
            gated_delta_decode_triton,
        )

        def fast_prefill(q, k, v, g, beta, pool, slots, layout):
            chunk_gated_delta_rule_triton(q, k, v, g, beta, pool[slots], layout)

        fast_decode = gated_delta_decode_triton
    else:

        def fast_prefill(q, k, v, g, beta, pool, slots, layout):
            cpu_gated_delta.gated_delta_prefill_cpu(q, k, v, g, beta, pool, slots, layout, True)

        fast_decode = cpu_gated_delta.gated_delta_decode_cpu
    rows = []
    for label, lens in PREFILLS.items():
        S = len(lens)
        args = (
            *rule_inputs(sum(lens), shape, device, dtype),
            torch.zeros(S + 1, Hv, dk, dv, device=device),
            torch.arange(1, S + 1, device=device),
            build_chunk_layout(lens, [0] * S, chunk, device),
        )
        fns = {"fast": partial(fast_prefill, *args), "torch": partial(torch_prefill, *args)}
        rows.append(row("prefill", label, timer(fns, rounds)))
    for batch in DECODE_BATCHES:
        args = (
            *rule_inputs(batch, shape, device, dtype),
            torch.zeros(batch + 1, Hv, dk, dv, device=device),
            torch.arange(1, batch + 1, device=device),
        )
        fns = {
            "fast": partial(fast_decode, *args),
            "torch": partial(gated_delta_decode_torch, *args),
        }
        rows.append(row("decode step", f"batch {batch}", timer(fns, rounds)))
    return rows


def bench_fused_decode(shape, dtype, rounds: int) -> list[dict]:
    """The fused C mixer step vs the composite torch path (conv update, gating, rule, norm)."""
    Hk, Hv, dk, dv, _ = shape
    dims = GDNMixerDims(num_k_heads=Hk, num_v_heads=Hv, k_head_dim=dk, v_head_dim=dv,
                        beta_scale=1.0, norm_eps=1e-6)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    weights = GDNMixerWeights(
        conv_weight=(torch.randn(dims.conv_dim, CONV_K, generator=gen) * 0.5).to(dtype),
        A_log=torch.rand(Hv, generator=gen),
        dt_bias=torch.zeros(Hv),
        norm_weight=torch.ones(dv, dtype=dtype),
    )
    params = weights.decode_params()
    rows = []
    for batch in DECODE_BATCHES:
        qkv = torch.randn(batch, dims.conv_dim, generator=gen).to(dtype)
        z = torch.randn(batch, Hv * dv, generator=gen).to(dtype)
        a, b = torch.randn(batch, Hv, generator=gen).to(dtype), torch.randn(batch, Hv).to(dtype)
        conv = torch.zeros(batch + 1, dims.conv_dim, CONV_K - 1, dtype=dtype)
        pool = torch.zeros(batch + 1, Hv, dk, dv)
        slots = torch.arange(1, batch + 1)
        args = (qkv, z, a, b, conv, pool, slots, weights, dims)
        fns = {"fast": partial(gdn_mixer_decode, *args, params),
               "torch": partial(gdn_mixer_decode, *args, None)}  # fmt: skip
        rows.append(row("fused mixer decode", f"batch {batch}", best_of(fns, rounds)))
    return rows


def row(kernel: str, shape: str, ms: dict[str, float]) -> dict:
    result = dict(kernel=kernel, shape=shape, fast_ms=ms["fast"], torch_ms=ms["torch"])
    print(f"{kernel:<20} {shape:<10} {ms['fast']:10.3f} {ms['torch']:10.3f} "
          f"{ms['torch'] / ms['fast']:8.2f}x", flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-next")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch's and C's)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
    use_cuda = torch.cuda.is_available() and not interpreted
    device = torch.device("cuda" if use_cuda else "cpu")
    if not use_cuda and cpu_gated_delta.library() is None:
        print(
            "baton.bench.kernels.gdn_kernels: the C kernels did not build (see the warning); nothing to time"
        )
        return 1
    dtype, shape = getattr(torch, args.dtype), SHAPES[args.shapes]
    fast = "triton" if use_cuda else "C"
    print(f"device {device}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}; shapes {args.shapes} (Hk, Hv, dk, dv, chunk) = {shape}, "
          f"{args.dtype}")  # fmt: skip
    print(f"{'kernel':<20} {'shape':<10} {fast + ' ms':>10} {'torch ms':>10} {'torch/' + fast:>9}")
    timer = cuda_timer if use_cuda else best_of
    with torch.inference_mode():
        results = bench_rule(shape, device, dtype, args.rounds, timer)
        if not use_cuda:
            results += bench_fused_decode(shape, dtype, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            report = dict(device=str(device), fast_path=fast, shapes=args.shapes, dtype=args.dtype,
                          load_average=os.getloadavg()[0], results=results)  # fmt: skip
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
