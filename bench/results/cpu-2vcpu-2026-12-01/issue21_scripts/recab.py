import ctypes
import statistics
import sys
import time

import torch

sys.path.insert(0, "/work/wt21e")
from kernels import cpu_prefill
from kernels.ssd import build_chunk_layout

threads = int(sys.argv[1])
torch.set_num_threads(threads)
rec = ctypes.CDLL("/tmp/w21e/rec.so")
P_ = ctypes.c_void_p
I = ctypes.c_int64
rec.rec.argtypes = [P_] * 8 + [P_, I, I, I, I, I, ctypes.c_int]
SHAPES = {"110m": (24, 64, 8, 128, 128), "19m": (8, 32, 2, 64, 64)}
for config, (H, P, G, N, L) in SHAPES.items():
    for bname, lens in {"32x128 zero state": [128] * 32, "1x2048 zero state": [2048]}.items():
        S, T = len(lens), sum(lens)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, H, P, generator=g)
        dt = torch.rand(T, H, generator=g) * 0.1
        A, D = -torch.rand(H, generator=g) - 0.2, torch.randn(H, generator=g)
        B = torch.randn(T, G, N, generator=g)
        C = torch.randn(T, G, N, generator=g)
        slots = torch.arange(S)
        layout = build_chunk_layout(lens, [0] * S, L, "cpu")
        cu = layout.cu_seqlens.to(torch.int64).contiguous()
        tt = {"gemm": [], "rec": []}
        for _r in range(5):
            pool = torch.zeros(S, H, P, N)
            t0 = time.perf_counter()
            y1, _ = cpu_prefill.ssd_prefill_cpu(
                x, dt, A, B, C, D, pool, slots, layout.cu_seqlens, layout.start_pos, L, None
            )
            tt["gemm"].append(time.perf_counter() - t0)
            pool2 = torch.zeros(S, H, P, N)
            y2 = torch.empty(T, H, P)
            t0 = time.perf_counter()
            rec.rec(
                x.data_ptr(),
                B.data_ptr(),
                C.data_ptr(),
                dt.data_ptr(),
                A.data_ptr(),
                D.data_ptr(),
                pool2.data_ptr(),
                y2.data_ptr(),
                cu.data_ptr(),
                S,
                H,
                P,
                N,
                G,
                threads,
            )
            tt["rec"].append(time.perf_counter() - t0)
        err = ((y1 - y2).abs().max() / y1.abs().max()).item()
        print(
            f"{config} {bname} t={threads}: chunked GEMM form min {min(tt['gemm']) * 1e3:.1f} med {statistics.median(tt['gemm']) * 1e3:.1f} ms | recurrence min {min(tt['rec']) * 1e3:.1f} med {statistics.median(tt['rec']) * 1e3:.1f} ms | rec/gemm {min(tt['rec']) / min(tt['gemm']):.2f} | y rel diff {err:.1e}",
            flush=True,
        )
print("load", open("/proc/loadavg").read().strip())
