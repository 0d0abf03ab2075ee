"""A/B: old vs new cpu_prefill .so alternated in one process. usage: ab.py OLD.c NEW.c [threads] [rounds]"""

import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, "/work/wt21e")
from kernels import cpu_ops, cpu_prefill
from kernels.conv1d import build_conv_layout
from kernels.ssd import build_chunk_layout, discretize_dt


def build(src, tag):
    out = f"/tmp/w21e/{tag}.so"
    subprocess.run(
        ["gcc", *cpu_ops.FLAGS, "-I/work/wt21e/kernels", src, "-o", out, "-lm"], check=True
    )
    return out


def load(path):
    real = cpu_prefill.library.__wrapped__
    orig = cpu_ops.compile_library
    cpu_ops.compile_library = lambda s, f: ctypes.CDLL(path)
    try:
        return real()
    finally:
        cpu_ops.compile_library = orig


old_src, new_src = sys.argv[1], sys.argv[2]
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
torch.set_num_threads(threads)
libs = {"old": load(build(old_src, "old")), "new": load(build(new_src, "new"))}
SHAPES = {"110m": (24, 64, 8, 128, 128, 4), "19m": (8, 32, 2, 64, 64, 4)}
BATCHES = {"32x128": [128] * 32, "varlen": [512, 40, 300, 33, 129, 77], "1x2048": [2048]}
for config, (H, P, G, N, L, K) in SHAPES.items():
    for bname, lens in BATCHES.items():
        for dtype in (torch.float32, torch.bfloat16):
            S, T = len(lens), sum(lens)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(T, H, P, generator=g).to(dtype)
            dt = torch.randn(T, H, generator=g)
            A, D = -torch.rand(H, generator=g) - 0.2, torch.randn(H, generator=g)
            B = torch.randn(T, G, N, generator=g).to(dtype)
            C = torch.randn(T, G, N, generator=g).to(dtype)
            pool0 = (
                torch.randn(S, H, P, N, generator=g)
                if bname == "varlen"
                else torch.zeros(S, H, P, N)
            )
            slots = torch.arange(S)
            layout = build_chunk_layout(lens, [0] * S, L, "cpu")
            dtd = discretize_dt(dt, torch.zeros(H), (0.0, float("inf")))
            dim = H * P + 2 * G * N
            xbc = torch.randn(T, dim + H * P, generator=g).to(dtype)[:, H * P :]
            weight, bias = torch.randn(dim, K), torch.randn(dim)
            cpool0 = torch.randn(S, dim, K - 1).to(dtype)
            clay = build_conv_layout(lens, K, "cpu")
            res = {}
            times = {(k, n): [] for k in ("scan", "conv") for n in libs}
            for _r in range(rounds):
                for name, lib in libs.items():
                    cpu_prefill.library = lambda lib=lib: lib
                    pool = pool0.clone()
                    cp = cpool0.clone()
                    t0 = time.perf_counter()
                    y, cs = cpu_prefill.ssd_prefill_cpu(
                        x,
                        dtd,
                        A,
                        B,
                        C,
                        D,
                        pool,
                        slots,
                        layout.cu_seqlens,
                        layout.start_pos,
                        L,
                        None,
                    )
                    t1 = time.perf_counter()
                    o, _ = (
                        (None, None)
                        if os.environ.get("SCANONLY")
                        else cpu_prefill.causal_conv1d_varlen_cpu(
                            xbc, weight, bias, cp, slots, clay
                        )
                    )
                    t2 = time.perf_counter()
                    times[("scan", name)].append(t1 - t0)
                    times[("conv", name)].append(t2 - t1)
                    res[name] = (
                        (y.float(), pool, cs)
                        if o is None
                        else (y.float(), pool, cs, o.float(), cp.float())
                    )
            err = max(
                (a - b).abs().max().item() / (b.abs().max().item() + 1e-30)
                for a, b in zip(res["old"], res["new"])
                if a is not None
            )
            # flops: per head-chunk GEMM form; report on "useful" recurrence basis 2*2PN per token-head for scan
            scan_fl = 2 * 2 * P * N * H * T
            conv_fl = 2 * K * dim * T
            for k, fl in (("scan", scan_fl),) + (
                () if os.environ.get("SCANONLY") else (("conv", conv_fl),)
            ):
                o_, n_ = times[(k, "old")], times[(k, "new")]
                print(
                    f"{config} {bname} {str(dtype)[6:]} t={threads} {k}: old min {min(o_) * 1e3:.2f} med {statistics.median(o_) * 1e3:.2f} ms | new min {min(n_) * 1e3:.2f} med {statistics.median(n_) * 1e3:.2f} ms | new/old {min(n_) / min(o_):.2f} | new {fl / min(n_) / 1e9:.1f} GFLOP/s(2x2PN basis) relerr {err:.1e}",
                    flush=True,
                )
print("load", open("/proc/loadavg").read().strip())
