"""baton's CPU decode attention on one call's shape, hot and cold (a 64 MB buffer written between
calls): python decode_attention_bench.py S H KVH Dh L (best of 30, bf16, 16-token pages)."""

import sys
import time

import torch

sys.path.insert(0, "/work/main")
from kernels.cpu_ops import decode_attention_cpu  # noqa: E402

torch.manual_seed(0)
S, H, KVH, Dh, L = (int(x) for x in sys.argv[1:6])
dtype = torch.bfloat16
slots = S * L + 1000
k = torch.randn(slots, KVH, Dh).to(dtype)
v = torch.randn(slots, KVH, Dh).to(dtype)
page = 16
pages = torch.randperm(slots // page)[: S * L // page].view(S, L // page)
idx = (pages[:, :, None] * page + torch.arange(page)).reshape(S, L).to(torch.int64)
lens = torch.full((S,), L, dtype=torch.int32)
q = torch.randn(S, H, Dh).to(dtype)
flush = torch.empty(64 << 20, dtype=torch.uint8)


def run(cold: bool) -> float:
    best = 1e9
    for _ in range(30):
        if cold:
            flush.add_(1)
        t = time.perf_counter()
        decode_attention_cpu(q, k, v, idx, lens, Dh**-0.5)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


kv_mb = 2 * S * L * KVH * Dh * 2 / 1e6
print(
    f"S{S} H{H} KVH{KVH} Dh{Dh} L{L}: hot {run(False):.0f} us, cold {run(True):.0f} us; KV {kv_mb:.1f} MB"
)
