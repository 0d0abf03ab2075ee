import collections
import sys
import time

import torch

sys.path.insert(0, ".")
from engine.cpu_allocator import keep_freed_memory_in_heap

keep_freed_memory_in_heap()
dt = getattr(torch, sys.argv[1])
M = int(sys.argv[2])
layer = (
    [(768, 5144), (1536, 768)] * 8 + [(768, 2048), (2048, 768)] * 6 + [(768, 1280), (768, 768)] * 2
)
ws = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dt) * 0.02) for k, n in layer]
xs = {k: torch.randn(M, k, dtype=dt) for k, _ in layer}
flops = sum(2 * M * k * n for k, n in layer)


def step():
    for (k, _n), w in zip(layer, ws):
        torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")


step()
ts = []
for _i in range(5):
    t = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t)
print(f"{dt} M={M}: {min(ts) * 1e3:.1f} ms {flops / min(ts) / 1e9:.0f} GFLOP/s")

acc = collections.defaultdict(float)
for (k, n), w in zip(layer, ws):
    t = time.perf_counter()
    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
    acc[(k, n)] += time.perf_counter() - t
cnt = collections.Counter(layer)
for s, v in acc.items():
    print(s, f"{2 * M * s[0] * s[1] * cnt[s] / v / 1e9:.0f} GFLOP/s")
