"""FP8 at one and two rows, hot (one 1024 x 1024 weight, in cache) on one and two threads, then
cold (30 copies of the 110M in_proj shape): GB/s of the codes and scales per call, less ~15 us of
each call's Python. From the repository root:
`python bench/results/cpu-2vcpu-2026-12-03/s8-spr/fp8_one_row.py`."""

import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from baton.kernels.cpu import quant as cpu_quant  # noqa: E402
from baton.kernels.quant import QuantizedTensor  # noqa: E402


def fp8(n, k, group, g):
    w = torch.randn(n, k, generator=g)
    amax = w.abs().view(n, -1, group).amax(-1)
    scale = amax / 448
    codes = (w / scale.repeat_interleave(group, -1)[:, :k]).to(torch.float8_e4m3fn)
    return QuantizedTensor("fp8", codes, scale, None, group)


def median_call(fn, n=300):
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for group in (1024, 128):
            for rows in (1, 2):
                p = cpu_quant.pack(fp8(1024, 1024, group, g))
                x = torch.randn(rows, 1024, generator=g).bfloat16()
                t = median_call(lambda x=x, p=p: cpu_quant.linear(x, p))
                print(
                    f"hot, {threads} thread(s), group {group}, {rows} row(s): "
                    f"{p.nbytes() / (t - 15e-6) / 1e9:.1f} GB/s"
                )
    torch.set_num_threads(2)
    packs = [cpu_quant.pack(fp8(5144, 768, 768, g)) for _ in range(30)]
    x = torch.randn(1, 768, generator=g).bfloat16()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for p in packs:
            cpu_quant.linear(x, p)
        best = min(best, (time.perf_counter() - start) / len(packs))
    print(f"cold 768 x 5144, one row: {packs[0].nbytes() / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
