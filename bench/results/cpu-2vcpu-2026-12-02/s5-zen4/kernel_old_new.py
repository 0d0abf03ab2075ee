import sys, time, torch, ctypes
sys.path.insert(0, '.')
from kernels import cpu_quant
from kernels.quant import QuantizedTensor
torch.manual_seed(0)
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
libs = {}
for name in ("old", "new"):
    lib = ctypes.CDLL(f"/tmp/s5/q_{name}.so")
    for f in (lib.baton_qgemm_bf16, lib.baton_qgemm):
        f.restype = _int
        f.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _int, _ptr, _i64, _int]
    libs[name] = lib
def mk(N, K):
    data = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    scale = torch.randint(0x30, 0x50, (N, K // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    pairs = cpu_quant._panels(data)
    return {"old": pairs, "new": cpu_quant._fp4_lanes(pairs)}, cpu_quant._panels(scale.view(torch.uint8)), torch.ones(N)
for (K, N, cnt) in [(768, 5144, 20), (4096, 4096, 6)]:
    ws = [mk(N, K) for _ in range(cnt)]
    nbytes = sum(c["old"].numel() + s.numel() for c, s, _ in ws)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 4, 8, 32):
            x = torch.randn(rows, K).to(dtype); y = torch.empty(rows, N, dtype=dtype)
            best = {v: 1e9 for v in libs}
            for r in range(8):
                for v, lib in libs.items():
                    f = lib.baton_qgemm_bf16 if dtype == torch.bfloat16 else lib.baton_qgemm
                    t = time.perf_counter()
                    for c, s, col in ws:
                        f(1, x.data_ptr(), rows, K, K, c[v].data_ptr(), s.data_ptr(), 16, col.data_ptr(), N, None, 0, y.data_ptr(), N, 2)
                    best[v] = min(best[v], time.perf_counter() - t)
            print(f"{K}x{N} {dtype} rows {rows}: " + "  ".join(f"{v} {nbytes/b/1e9:.1f} GB/s" for v, b in best.items()), flush=True)
