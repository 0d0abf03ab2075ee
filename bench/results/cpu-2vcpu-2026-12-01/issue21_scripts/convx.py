import statistics
import sys
import time

import torch

sys.path.insert(0, "/work/wt21e")
from kernels import cpu_prefill
from kernels.conv1d import build_conv_layout

torch.set_num_threads(int(sys.argv[1]))
H, P, G, N, K = 24, 64, 8, 128, 4
dim = H * P + 2 * G * N
for lens in ([128] * 16, [2048], [128] * 32):
    for dtype in (torch.bfloat16, torch.float32):
        S, T = len(lens), sum(lens)
        xbc = torch.randn(T, dim + H * P).to(dtype)[:, H * P :]
        weight, bias = torch.randn(dim, K), torch.randn(dim)
        cp = torch.randn(S, dim, K - 1).to(dtype)
        slots = torch.arange(S)
        clay = build_conv_layout(lens, K, "cpu")
        ts, tk = [], []
        for _i in range(12):
            t = time.perf_counter()
            o, _ = cpu_prefill.causal_conv1d_varlen_cpu(xbc, weight, bias, cp, slots, clay)
            ts.append(time.perf_counter() - t)
            # same but output memory pre-touched: what the kernel alone costs
            out = torch.empty(T, dim, dtype=dtype)
            out.zero_()
            cu = torch.zeros(S + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(torch.tensor(lens), 0)
            t = time.perf_counter()
            cpu_prefill.library().baton_conv_varlen(
                xbc.data_ptr(),
                xbc.stride(0),
                weight.data_ptr(),
                bias.data_ptr(),
                cp.data_ptr(),
                S,
                slots.data_ptr(),
                cu.data_ptr(),
                S,
                out.data_ptr(),
                None,
                None,
                dim,
                K,
                int(dtype == torch.bfloat16),
                torch.get_num_threads(),
            )
            tk.append(time.perf_counter() - t)
        print(
            f"{S}x{T // S} {dtype} t={sys.argv[1]}: wrapper+fresh out min {min(ts) * 1e3:.2f} med {statistics.median(ts) * 1e3:.2f} ms | kernel into touched out min {min(tk) * 1e3:.2f} med {statistics.median(tk) * 1e3:.2f} ms",
            flush=True,
        )
