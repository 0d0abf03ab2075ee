import collections
import sys
import time

import torch

torch.manual_seed(0)
dt = torch.bfloat16
M = int(sys.argv[1]) if len(sys.argv) > 1 else 32
layer = (
    [(768, 5144), (1536, 768)] * 8
    + [(768, 2048), (2048, 768)] * 6
    + [(768, 1280), (768, 768)] * 2
    + [(768, 32000)]
)
ws = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dt) * 0.02) for k, n in layer]
xs = {k: torch.randn(M, k, dtype=dt) for k, _ in layer}
flops = sum(2 * M * k * n for k, n in layer)
byts = sum(2 * k * n for k, n in layer)


def step():
    for (k, _n), w in zip(layer, ws):
        torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")


step()
ts = []
for _i in range(10):
    t = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t)
print(
    f"cold-ish step M={M}: {min(ts) * 1e3:.2f} ms (median {sorted(ts)[5] * 1e3:.2f}); {flops / min(ts) / 1e9:.0f} GFLOP/s, weights {byts / 1e6:.0f} MB -> {byts / min(ts) / 1e9:.0f} GB/s"
)


# hot: same layer repeated
def hot():
    for (k, _n), w in zip(layer, ws):
        for _r in range(3):
            torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")


hot()
t = time.perf_counter()
hot()
dt_ = (time.perf_counter() - t) / 3
print(f"hot-ish (each weight x3) per pass: {dt_ * 1e3:.2f} ms {flops / dt_ / 1e9:.0f} GFLOP/s")

acc = collections.defaultdict(float)
for _it in range(10):
    for _i, ((k, n), w) in enumerate(zip(layer, ws)):
        t = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
        acc[(k, n)] += time.perf_counter() - t
cnt = collections.Counter(layer)
for s, v in acc.items():
    per = v / 10 / cnt[s]
    print(s, f"{per * 1e3:.3f} ms/call  {2 * M * s[0] * s[1] / per / 1e9:.0f} GFLOP/s")
# isolated
for s in cnt:
    w = ws[layer.index(s)]
    x = xs[s[0]]
    for _r in range(3):
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    b = 1e9
    for _r in range(20):
        t = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        b = min(b, time.perf_counter() - t)
    print("iso", s, f"{b * 1e3:.3f}")
