import sys
import time

import torch

torch.manual_seed(0)


def packed(w):
    return (
        torch.ops.mkldnn._reorder_linear_weight(
            w, None, w.shape[0], w.shape[1], w.dtype if False else None
        )
        if False
        else torch.ops.mkldnn._reorder_linear_weight(w)
    )


def bench(fn, reps=20):
    fn()
    fn()
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


dt = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16
a = torch.randn(2048, 2048, dtype=dt)
b = torch.randn(2048, 2048, dtype=dt)
t = bench(lambda: torch.mm(a, b), 5)
peak = 2 * 2048**3 / t / 1e9
print(f"peak {dt} {peak:.0f} GFLOP/s threads={torch.get_num_threads()}")
shapes = {
    "in_proj": (768, 5144),
    "out_proj": (1536, 768),
    "up": (768, 2048),
    "down": (2048, 768),
    "qkv": (768, 1280),
    "o": (768, 768),
    "lm_head": (768, 32000),
}
for M in (32, 64, 128):
    tot_f = 0
    tot_t = 0
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, dtype=dt) * 0.02
        p = torch.ops.mkldnn._reorder_linear_weight(w, None) if False else None
        try:
            p = torch.ops.mkldnn._reorder_linear_weight(w, None, [M, k])
        except Exception:
            p = torch.ops.mkldnn._reorder_linear_weight(w)
        x = torch.randn(M, k, dtype=dt)
        t = bench(lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        f = 2 * M * k * n
        tot_f += f
        tot_t += t
        print(
            f"M={M} {name} {k}x{n}: {t * 1e3:.3f} ms {f / t / 1e9:.0f} GFLOP/s {f / t / 1e9 / peak * 100:.0f}%"
        )
    print(f"M={M} all: {tot_f / tot_t / 1e9:.0f} GFLOP/s {tot_f / tot_t / 1e9 / peak * 100:.0f}%")
