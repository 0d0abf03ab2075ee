"""How to roll a recurrent state back after a speculative verify, measured on the CPU kernels.

    python -m baton.bench.offline.spec_rollback [--config 110m|nano9b] [--threads N] [--output FILE]

A verify feeds q = k + 1 tokens per request; acceptance keeps the state after token j. Two ways:

  keep     (what baton does) the verify writes the state after EACH token to its own slot
           (kernels/cpu/verify.c): rollback is choosing slot j, nothing else runs
  replay   the verify keeps the state in registers and writes none of it back (the working
           slot stays the snapshot); after acceptance a second pass over every recurrent layer
           reads the snapshot again and applies the j + 1 kept tokens

Both are timed with the fused verify step on one Mamba2 layer of the config's shape: `replay`'s
verify as the same step writing to a single cache-hot scratch slot (what not writing back costs
at most), its replay as the step over j + 1 tokens writing the last state back (j = k / 2, a
typical acceptance). The ratio keep / replay per layer and step is printed for batch 1, 8 and
32 and k = 1, 2, 4. Replay would also need the kept tokens' inputs of every layer held until
acceptance and its own pass (with its own synchronisation at tensor parallelism, outside any
CUDA graph): keeping every position is chosen unless it costs clearly more.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.cpu.verify import mamba_verify_cpu

SHAPES = {  # (heads, head_dim, d_state, n_groups, conv kernel)
    "110m": (24, 64, 128, 8, 4),
    "nano9b": (128, 80, 128, 8, 4),
}


def layer(config: str, batch: int, q: int):
    H, P, N, G, K = SHAPES[config]
    I = H * P
    conv_dim = I + 2 * G * N
    slots = 1 + batch * (q + 1)
    g = torch.Generator().manual_seed(0)
    zxbcdt = torch.randn(batch * q, I + conv_dim + H, generator=g)
    conv = torch.randn(slots, conv_dim, K - 1, generator=g)
    ssm = torch.randn(slots, H, P, N, generator=g)
    params = cpu_ops.MambaDecodeParams(
        conv_weight=torch.randn(conv_dim, K, generator=g),
        conv_bias=torch.randn(conv_dim, generator=g),
        dt_bias=torch.randn(H, generator=g),
        A=-torch.rand(H, generator=g),
        D=torch.randn(H, generator=g),
        norm_weight=torch.ones(I),
    )
    dims = dict(num_heads=H, head_dim=P, n_groups=G, d_state=N, norm_group=I // G)
    return zxbcdt, conv, ssm, params, dims


def timed(step, repeats: int) -> float:
    step()
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - started) / repeats


def measure(config: str, batch: int, k: int, repeats: int) -> dict:
    q = k + 1
    zxbcdt, conv, ssm, params, dims = layer(config, batch, q)
    working = torch.arange(1, batch + 1)
    # keep: [working, working, scratch 1..k] per request, distinct scratch slots
    scratch = torch.arange(batch + 1, batch + 1 + batch * k).view(batch, k)
    keep_table = torch.cat([working[:, None], working[:, None], scratch], dim=1)
    # replay's verify: every state written to the dummy slot 0 (hot in cache)
    verify_table = torch.cat([working[:, None], torch.zeros(batch, q, dtype=torch.int64)], dim=1)
    kept = k // 2 + 1
    replay_rows = zxbcdt.view(batch, q, -1)[:, :kept].reshape(batch * kept, -1)
    replay_table = torch.cat(
        [working[:, None], torch.zeros(batch, kept - 1, dtype=torch.int64), working[:, None]], dim=1
    )

    def run(rows, table):
        mamba_verify_cpu(
            rows, conv, ssm, table, params, (0.0, 1e30), 1e-5, **dims, norm_mode="gated"
        )

    keep = timed(lambda: run(zxbcdt, keep_table), repeats)
    replay = timed(lambda: run(zxbcdt, verify_table), repeats) + timed(
        lambda: run(replay_rows, replay_table), repeats
    )
    return {
        "batch": batch,
        "k": k,
        "keep_ms": round(keep * 1e3, 3),
        "replay_ms": round(replay * 1e3, 3),
        "keep_over_replay": round(keep / replay, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton.bench.offline.spec_rollback")
    parser.add_argument("--config", choices=list(SHAPES), default="110m")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for batch in (1, 8, 32):
        for k in (1, 2, 4):
            row = measure(args.config, batch, k, args.repeats)
            results.append(row)
            print(json.dumps(row), flush=True)
    summary = {"config": args.config, "threads": torch.get_num_threads(), "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
