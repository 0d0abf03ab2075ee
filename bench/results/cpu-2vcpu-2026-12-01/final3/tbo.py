import sys
import threading
import time

import torch

sys.path.insert(0, "/work/main")
from engine.cpu_allocator import keep_freed_memory_in_heap
from kernels import cpu_ops

keep_freed_memory_in_heap()
torch.manual_seed(0)
dt = torch.bfloat16
H, P, G, N, K = 24, 64, 8, 128, 4
I = H * P
conv_dim = I + 2 * G * N
width = I + conv_dim + H
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
pat = "M-M-M*-M-M-M*-M-"


def packed(k, n):
    return torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k) * 0.02).to(dt))


layers = []
for c in pat:
    if c == "M":
        layers.append(
            (
                "M",
                packed(768, width),
                packed(I, 768),
                torch.zeros(B, conv_dim, K - 1, dtype=dt),
                torch.randn(B, H, P, N) * 0.01,
            )
        )
    elif c == "-":
        layers.append(("-", packed(768, 2048), packed(2048, 768)))
    else:
        layers.append(("*", packed(768, 1280), packed(768, 768)))
lm = packed(768, 32000)
params = cpu_ops.MambaDecodeParams(
    torch.randn(conv_dim, K) * 0.1,
    torch.zeros(conv_dim),
    torch.zeros(H),
    -torch.rand(H) - 0.5,
    torch.ones(H),
    torch.ones(I),
)


def lin(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def forward(rows):
    n = rows.stop - rows.start
    slots = torch.arange(rows.start, rows.stop)
    h = torch.randn(n, 768).to(dt)
    for l in layers:
        if l[0] == "M":
            z = lin(h, l[1])
            g = cpu_ops.mamba_decode_cpu(
                z,
                l[3],
                l[4],
                slots,
                params,
                (0.0, float("inf")),
                1e-5,
                num_heads=H,
                head_dim=P,
                n_groups=G,
                d_state=N,
                norm_group=I // G,
            )
            h = h + lin(g, l[2])
        elif l[0] == "-":
            u = torch.relu(lin(h, l[1]))
            u = u * u
            h = h + lin(u, l[2])
        else:
            q = lin(h, l[1])
            h = h + lin(q[:, :768].contiguous(), l[2])
    return lin(h, lm).float().argmax(-1)


def single():
    forward(range(0, B))


def split():
    def run(r):
        torch.set_num_threads(1)
        forward(r)

    ts = [
        threading.Thread(target=run, args=(range(0, B // 2),)),
        threading.Thread(target=run, args=(range(B // 2, B),)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


for f in (single, split):
    f()
    f()
res = {"single": [], "split": []}
for _r in range(8):
    for name, f in (("single", single), ("split", split)):
        t = time.perf_counter()
        f()
        res[name].append(time.perf_counter() - t)
for k, v in res.items():
    print(f"B={B} {k}: min {min(v) * 1e3:.2f} ms median {sorted(v)[4] * 1e3:.2f} ms")
