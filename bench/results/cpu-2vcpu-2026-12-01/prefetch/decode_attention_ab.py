"""A/B variants of kernels/cpu_ops.c's decode attention in one process, alternated 15 rounds:
python decode_attention_ab.py S H KVH Dh L NAME... where /tmp/w/var_NAME.c is a (modified) copy
of kernels/cpu_ops.c; prints hot and cold (64 MB written between calls) medians, bf16, 2 threads,
16-token pages in random order, and each variant's largest difference from the first."""

import ctypes
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, "/work/main")
S, H, KVH, Dh, L = (int(x) for x in sys.argv[1:6])
variants = sys.argv[6:]
libs = {}
for name in variants:
    so = f"/tmp/w/var_{name}.so"
    src = f"/tmp/w/var_{name}.c"
    subprocess.run(
        [
            "gcc",
            "-O3",
            "-march=native",
            "-fopenmp",
            "-shared",
            "-fPIC",
            "-std=c11",
            "-I/work/main/kernels",
            src,
            "-o",
            so,
            "-lm",
        ],
        check=True,
    )
    lib = ctypes.CDLL(so)
    f = lib.baton_decode_attention
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f.restype = i64
    f.argtypes = [p, p, p, i64, p, i64, p, p, i64, i64, i64, i64, ctypes.c_float, i, i]
    libs[name] = f
torch.manual_seed(0)
dtype = torch.bfloat16
slots = S * L + 1000
k = torch.randn(slots, KVH, Dh).to(dtype)
v = torch.randn(slots, KVH, Dh).to(dtype)
page = 16
pages = torch.randperm(slots // page)[: S * L // page].view(S, L // page)
idx = (pages[:, :, None] * page + torch.arange(page)).reshape(S, L).to(torch.int64).contiguous()
lens = torch.full((S,), L, dtype=torch.int32)
q = torch.randn(S, H, Dh).to(dtype)
flush = torch.empty(64 << 20, dtype=torch.uint8)
outs = {}


def once(name, cold):
    out = torch.empty(S, H, Dh, dtype=dtype)
    if cold:
        flush.add_(1)
    t = time.perf_counter()
    r = libs[name](
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        slots,
        idx.data_ptr(),
        idx.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        S,
        H,
        KVH,
        Dh,
        Dh**-0.5,
        1,
        2,
    )
    dt = time.perf_counter() - t
    assert r == 0
    outs[name] = out
    return dt


res = {n: {"hot": [], "cold": []} for n in variants}
for _round in range(15):
    for n in variants:
        for kind in ("hot", "cold"):
            res[n][kind].append(min(once(n, kind == "cold") for _ in range(3)))
base = outs[variants[0]]
for n in variants:
    err = (outs[n].float() - base.float()).abs().max().item()
    print(
        f"{n:10s} hot median {statistics.median(res[n]['hot']) * 1e6:7.0f} us  cold median {statistics.median(res[n]['cold']) * 1e6:7.0f} us  maxdiff {err:.3g}"
    )
