"""The NVFP4 linear kernel before (a byte per column and input pair) and after (a 32-bit lane per
column and 8 inputs) on the same weights, cold (every weight once per round), alternated, best of
8 rounds: GB/s of packed weight bytes. Build the two libraries first (from the repository root):

    git show 6ed784b:kernels/cpu/quant.c > /tmp/s5/old_quant.c
    git show 6ed784b:kernels/cpu/quant.h > /tmp/s5/cpu_quant.h; cp kernels/cpu/common.h /tmp/s5/
    gcc -O3 -march=native -fopenmp -shared -fPIC -std=c11 -o /tmp/s5/q_old.so /tmp/s5/old_quant.c
    gcc -O3 -march=native -fopenmp -shared -fPIC -std=c11 -o /tmp/s5/q_new.so kernels/cpu/quant.c
"""

import ctypes
import sys
import time

import torch

sys.path.insert(0, ".")
from baton.kernels.cpu import quant as cpu_quant  # noqa: E402

I64, INT, PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
ARGTYPES = [INT, PTR, I64, I64, I64, PTR, PTR, I64, PTR, I64, PTR, INT, PTR, I64, INT]


def load(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(f"/tmp/s5/q_{name}.so")
    for entry in (lib.baton_qgemm_bf16, lib.baton_qgemm):
        entry.restype, entry.argtypes = INT, ARGTYPES
    return lib


def weight(n: int, k: int):
    """Random NVFP4 codes in both layouts, their packed scales and a unit column scale."""
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scale = torch.randint(0x30, 0x50, (n, k // 16), dtype=torch.uint8)
    pairs = cpu_quant._panels(data)
    codes = {"old": pairs, "new": cpu_quant._fp4_lanes(pairs)}
    return codes, cpu_quant._panels(scale), torch.ones(n)


def main() -> None:
    torch.manual_seed(0)
    libs = {name: load(name) for name in ("old", "new")}
    for k, n, count in [(768, 5144, 20), (4096, 4096, 6)]:
        weights = [weight(n, k) for _ in range(count)]
        nbytes = sum(codes["old"].numel() + scales.numel() for codes, scales, _ in weights)
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 4, 8, 32):
                x, y = torch.randn(rows, k).to(dtype), torch.empty(rows, n, dtype=dtype)
                best = dict.fromkeys(libs, float("inf"))
                for _ in range(8):
                    for name, lib in libs.items():
                        entry = lib.baton_qgemm_bf16 if dtype == torch.bfloat16 else lib.baton_qgemm
                        start = time.perf_counter()
                        for codes, scales, col in weights:
                            entry(
                                *(1, x.data_ptr(), rows, k, k, codes[name].data_ptr()),
                                *(scales.data_ptr(), 16, col.data_ptr(), n, None, 0),
                                *(y.data_ptr(), n, 2),
                            )
                        best[name] = min(best[name], time.perf_counter() - start)
                rates = "  ".join(f"{name} {nbytes / s / 1e9:.1f} GB/s" for name, s in best.items())
                print(f"{k}x{n} {dtype} rows {rows}: {rates}", flush=True)


if __name__ == "__main__":
    main()
