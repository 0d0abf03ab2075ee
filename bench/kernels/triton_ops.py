"""Time every Triton kernel against its torch path at Nemotron-Nano-9B-v2 shapes (CUDA only).

    .venv/bin/python -m baton.bench.kernels.triton_ops [--json bench_kernels.json] [--context 2048]

Per kernel and shape it prints the Triton time, the torch-path time, the bytes the kernel must
move at least (inputs read once, outputs written once) and the bandwidth that gives, as a
fraction of the device's theoretical peak (memory clock x bus width, from the CUDA device
properties) and of a device-to-device copy measured in the same run (the practical ceiling).
Decode kernels (selective state update, conv update, paged attention) run at batches 1..256,
prefill kernels at 8k tokens. The fused MoE kernel runs at Nemotron-3-Nano-30B-A3B's expert
shapes (hidden 2688, 128 experts of width 1856, top-6) at decode batches 1..256 against the
torch path (which syncs for per-expert counts); its bytes are the weights of the experts the
batch really touches plus the activations. Attention prefill is compute-bound, so its bandwidth fraction is
low by nature; read its Triton/torch ratio instead.

On a machine without CUDA it says so and exits 0. `--smoke` runs tiny shapes wherever it is
(on the CPU with TRITON_INTERPRET=1) to check this script, not to time anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Shapes:
    heads: int  # Mamba heads
    head_dim: int
    groups: int
    d_state: int
    chunk: int
    conv_dim: int
    conv_kernel: int
    q_heads: int
    kv_heads: int
    attn_head_dim: int
    page: int
    hidden: int
    prefill_tokens: int
    decode_batches: tuple[int, ...]


NANO_9B_V2 = Shapes(
    heads=128,
    head_dim=80,
    groups=8,
    d_state=128,
    chunk=128,
    conv_dim=12288,
    conv_kernel=4,
    q_heads=40,
    kv_heads=8,
    attn_head_dim=128,
    page=16,
    hidden=4480,
    prefill_tokens=8192,
    decode_batches=(1, 8, 32, 64, 128, 256),
)
SMOKE = Shapes(
    heads=4,
    head_dim=16,
    groups=2,
    d_state=8,
    chunk=16,
    conv_dim=32,
    conv_kernel=4,
    q_heads=4,
    kv_heads=2,
    attn_head_dim=16,
    page=16,
    hidden=64,
    prefill_tokens=40,
    decode_batches=(1, 3),
)


@dataclass(frozen=True, kw_only=True)
class Result:
    kernel: str
    shape: str
    bytes: int
    triton_ms: float
    torch_ms: float

    def row(self, peak_gbps: float | None, copy_gbps: float) -> str:
        gbps = self.bytes / self.triton_ms / 1e6
        peak = f"{gbps / peak_gbps:6.1%}" if peak_gbps else "   n/a"
        return (
            f"{self.kernel:<22} {self.shape:<28} {self.triton_ms:9.3f} {self.torch_ms:9.3f} "
            f"{self.torch_ms / self.triton_ms:7.2f}x {gbps:8.1f} {peak} {gbps / copy_gbps:6.1%}"
        )


def measure(timer, kernel: str, shape: str, moved: int, triton_fn, torch_fn, args) -> Result:
    """Time the Triton launcher and the torch path on the same arguments."""
    return Result(
        kernel=kernel,
        shape=shape,
        bytes=moved,
        triton_ms=timer(lambda: triton_fn(*args)),
        torch_ms=timer(lambda: torch_fn(*args)),
    )


def copy_states_torch(dst_pool, dst_slots, src, src_index) -> None:
    """The torch path of baton.kernels.state_copy.copy_states (it lives in the public function)."""
    dst_pool[dst_slots] = src[src_index].to(dst_pool.dtype)


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def once(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def theoretical_peak_gbps(device: torch.device) -> float | None:
    """Double data rate x bus width, from the CUDA properties (None where they are missing)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def copy_gbps(device: torch.device, timer) -> float:
    numel = (1 << 28) if device.type == "cuda" else (1 << 20)  # 1 GiB of float32 on a GPU
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def mamba_inputs(s: Shapes, rows: int, dtype: torch.dtype, device: torch.device):
    """x, dt, B, C for `rows` tokens and A, D, dt_bias initialised the Mamba2 way."""
    x = torch.randn(rows, s.heads, s.head_dim, device=device, dtype=dtype)
    dt = torch.randn(rows, s.heads, device=device, dtype=dtype) * 0.5
    B = torch.randn(rows, s.groups, s.d_state, device=device, dtype=dtype)
    C = torch.randn(rows, s.groups, s.d_state, device=device, dtype=dtype)
    A = -torch.exp(torch.rand(s.heads, device=device) * math.log(16))
    dt0 = torch.exp(torch.rand(s.heads, device=device) * math.log(100) + math.log(1e-3))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    D = torch.randn(s.heads, device=device)
    return x, dt, A, B, C, D, dt_bias


def bench_decode(s: Shapes, device, dtype, timer, context: int) -> list[Result]:
    from baton.kernels.attention import build_attention_layout, paged_attention_torch
    from baton.kernels.conv1d import causal_conv1d_update_torch
    from baton.kernels.ssu import selective_state_update_torch
    from baton.kernels.triton.attention import paged_attention_triton
    from baton.kernels.triton.conv1d import causal_conv1d_update_triton
    from baton.kernels.triton.ssu import selective_state_update_triton

    results = []
    esize = torch.finfo(dtype).bits // 8
    H, P, G, N = s.heads, s.head_dim, s.groups, s.d_state
    for batch in s.decode_batches:
        x, dt, A, B, C, D, dt_bias = mamba_inputs(s, batch, dtype, device)
        pool = torch.zeros(batch + 1, H, P, N, device=device)
        slots = torch.arange(1, batch + 1, device=device)
        moved = 2 * batch * H * P * N * 4 + batch * (2 * H * P + H + 2 * G * N) * esize
        results.append(
            measure(
                timer,
                "selective_state_update",
                f"batch {batch}",
                moved,
                selective_state_update_triton,
                selective_state_update_torch,
                (pool, x, dt, A, B, C, D, dt_bias, slots),
            )
        )

        K = s.conv_kernel
        xc = torch.randn(batch, s.conv_dim, device=device, dtype=dtype)
        weight = torch.randn(s.conv_dim, K, device=device, dtype=dtype)
        bias = torch.randn(s.conv_dim, device=device, dtype=dtype)
        conv_pool = torch.zeros(batch + 1, s.conv_dim, K - 1, device=device, dtype=dtype)
        moved = (2 * batch * (K - 1) + 2 * batch + K + 1) * s.conv_dim * esize
        results.append(
            measure(
                timer,
                "causal_conv1d_update",
                f"batch {batch}",
                moved,
                causal_conv1d_update_triton,
                causal_conv1d_update_torch,
                (xc, weight, bias, conv_pool, slots),
            )
        )

        pages_per_seq = -(-context // s.page)
        kv_slots = (batch * pages_per_seq + 1) * s.page
        k_cache = torch.randn(kv_slots, s.kv_heads, s.attn_head_dim, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        kv_indices = torch.arange(s.page, s.page + batch * context, device=device).view(batch, -1)
        layout = build_attention_layout([1] * batch, [context] * batch, kv_indices, device)
        q = torch.randn(batch, s.q_heads, s.attn_head_dim, device=device, dtype=dtype)
        scale = s.attn_head_dim**-0.5
        moved = (2 * batch * context * s.kv_heads + 2 * batch * s.q_heads) * s.attn_head_dim * esize
        results.append(
            measure(
                timer,
                "paged_attention decode",
                f"batch {batch} x ctx {context}",
                moved,
                paged_attention_triton,
                paged_attention_torch,
                (q, k_cache, v_cache, layout, scale),
            )
        )
    return results


def bench_prefill(s: Shapes, device, dtype, timer) -> list[Result]:
    from baton.kernels.attention import build_attention_layout, paged_attention_torch
    from baton.kernels.conv1d import build_window_layout, causal_conv1d_varlen_torch
    from baton.kernels.norm import gated_rms_norm_torch, rms_norm_torch
    from baton.kernels.ssd import build_chunk_layout, ssd_scan_torch
    from baton.kernels.triton.attention import paged_attention_triton
    from baton.kernels.triton.conv1d import causal_conv1d_varlen_triton
    from baton.kernels.triton.norm import gated_rms_norm_triton, rms_norm_triton
    from baton.kernels.triton.ssd import ssd_scan_triton
    from baton.kernels.triton.state_copy import copy_states_triton

    results = []
    esize = torch.finfo(dtype).bits // 8
    T = s.prefill_tokens
    H, P, G, N = s.heads, s.head_dim, s.groups, s.d_state
    x, dt, A, B, C, D, dt_bias = mamba_inputs(s, T, dtype, device)
    for num_seqs in (1, 8):
        lens = [T // num_seqs] * num_seqs
        layout = build_chunk_layout(lens, [0] * num_seqs, s.chunk, device)
        init = torch.zeros(num_seqs, H, P, N, device=device)
        states = num_seqs * (2 + layout.num_chunks) * H * P * N * 4  # init, final, chunk ends
        moved = T * (2 * H * P + H + 2 * G * N) * esize + states
        results.append(
            measure(
                timer,
                "ssd_scan",
                f"{num_seqs} x {T // num_seqs} tokens",
                moved,
                ssd_scan_triton,
                ssd_scan_torch,
                (x, dt, A, B, C, D, dt_bias, init, layout),
            )
        )

    K = s.conv_kernel
    xc = torch.randn(T, s.conv_dim, device=device, dtype=dtype)
    weight = torch.randn(s.conv_dim, K, device=device, dtype=dtype)
    bias = torch.randn(s.conv_dim, device=device, dtype=dtype)
    conv_pool = torch.zeros(2, s.conv_dim, K - 1, device=device, dtype=dtype)
    slots = torch.ones(1, dtype=torch.int64, device=device)
    window_layout = build_window_layout([T], K, device)
    results.append(
        measure(
            timer,
            "causal_conv1d_varlen",
            f"1 x {T} tokens",
            2 * T * s.conv_dim * esize,
            causal_conv1d_varlen_triton,
            causal_conv1d_varlen_torch,
            (xc, weight, bias, conv_pool, slots, window_layout),
        )
    )

    k_cache = torch.randn(T + s.page, s.kv_heads, s.attn_head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    kv_indices = torch.arange(s.page, s.page + T, device=device)[None]
    attn_layout = build_attention_layout([T], [T], kv_indices, device)
    q = torch.randn(T, s.q_heads, s.attn_head_dim, device=device, dtype=dtype)
    scale = s.attn_head_dim**-0.5
    moved = 2 * T * (s.q_heads + s.kv_heads) * s.attn_head_dim * esize
    results.append(
        measure(
            timer,
            "paged_attention extend",
            f"1 x {T} tokens, causal",
            moved,
            paged_attention_triton,
            paged_attention_torch,
            (q, k_cache, v_cache, attn_layout, scale),
        )
    )

    h = torch.randn(T, s.hidden, device=device, dtype=dtype)
    w = torch.randn(s.hidden, device=device, dtype=dtype)
    results.append(
        measure(
            timer,
            "rms_norm",
            f"{T} x {s.hidden}",
            2 * T * s.hidden * esize,
            rms_norm_triton,
            rms_norm_torch,
            (h, w, 1e-5),
        )
    )
    width = H * P
    y, z = (
        torch.randn(T, width, device=device, dtype=dtype),
        torch.randn(T, width, device=device, dtype=dtype),
    )
    w = torch.randn(width, device=device, dtype=dtype)
    results.append(
        measure(
            timer,
            "gated_rms_norm",
            f"{T} x {width} / {G} groups",
            3 * T * width * esize,
            gated_rms_norm_triton,
            gated_rms_norm_torch,
            (y, z, w, 1e-5, width // G),
        )
    )

    checkpoints = 8
    ssm_pool = torch.zeros(2 * checkpoints, H, P, N, device=device)
    src = torch.arange(checkpoints, device=device)
    dst = src + checkpoints
    results.append(
        measure(
            timer,
            "copy_states",
            f"{checkpoints} SSM states",
            2 * checkpoints * H * P * N * 4,
            copy_states_triton,
            copy_states_torch,
            (ssm_pool, dst, ssm_pool, src),
        )
    )
    return results


@dataclass(frozen=True, kw_only=True)
class MoEShapes:
    hidden: int
    inter: int
    experts: int
    top_k: int
    decode_batches: tuple[int, ...]


NANO_30B_A3B_MOE = MoEShapes(
    hidden=2688, inter=1856, experts=128, top_k=6, decode_batches=(1, 8, 32, 64, 128, 256)
)
SMOKE_MOE = MoEShapes(hidden=64, inter=32, experts=8, top_k=2, decode_batches=(1, 3))


def bench_moe(s: MoEShapes, device, dtype, timer) -> list[Result]:
    from baton.kernels.moe import fused_moe_torch, route_sigmoid_grouped
    from baton.kernels.triton.moe import fused_moe_triton

    w_up = torch.randn(s.experts, s.inter, s.hidden, device=device, dtype=dtype) / s.hidden**0.5
    w_down = torch.randn(s.experts, s.hidden, s.inter, device=device, dtype=dtype) / s.inter**0.5
    gate = torch.randn(s.experts, s.hidden, device=device)
    bias = torch.zeros(s.experts, device=device)
    elt = torch.finfo(dtype).bits // 8
    results = []
    for batch in s.decode_batches:
        x = torch.randn(batch, s.hidden, device=device, dtype=dtype)
        routing = route_sigmoid_grouped(
            x, gate, bias, top_k=s.top_k, n_group=1, topk_group=1, norm_topk_prob=True, scaling=2.5
        )
        touched = routing.ids.unique().numel()
        moved = touched * 2 * s.inter * s.hidden * elt + 2 * batch * s.hidden * elt
        results.append(
            measure(
                timer,
                "fused_moe relu2",
                f"B={batch} {touched}/{s.experts} experts",
                moved,
                fused_moe_triton,
                fused_moe_torch,
                (x, w_up, w_down, routing, "relu2"),
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default="bench_kernels.json", help="where to write the results")
    parser.add_argument(
        "--context", type=int, default=2048, help="decode attention context per sequence"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on any device (checks the script)"
    )
    args = parser.parse_args(argv)

    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")
        shapes, moe_shapes, context = SMOKE, SMOKE_MOE, 40
    else:
        if not torch.cuda.is_available():
            print(
                "baton.bench.kernels.triton_ops: no CUDA device here, nothing to time (the Triton kernels run "
                "on a GPU; on the CPU the tests run them under TRITON_INTERPRET=1)."
            )
            return 0
        if interpreted:
            print(
                "baton.bench.kernels.triton_ops: TRITON_INTERPRET is on; unset it to time compiled kernels."
            )
            return 1
        device, shapes, context = torch.device("cuda"), NANO_9B_V2, args.context
        moe_shapes = NANO_30B_A3B_MOE
    dtype = getattr(torch, args.dtype)
    timer = make_timer(device)
    torch.manual_seed(0)
    peak = theoretical_peak_gbps(device)
    copy = copy_gbps(device, timer)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    print(
        f"device {name}; theoretical peak "
        f"{f'{peak:.0f} GB/s' if peak else 'unknown'}; measured copy {copy:.0f} GB/s; {dtype}"
    )
    results = bench_decode(shapes, device, dtype, timer, context)
    results += bench_prefill(shapes, device, dtype, timer)
    results += bench_moe(moe_shapes, device, dtype, timer)
    print(
        f"{'kernel':<22} {'shape':<28} {'triton ms':>9} {'torch ms':>9} {'speedup':>8} "
        f"{'GB/s':>8} {'%peak':>6} {'%copy':>6}"
    )
    for r in results:
        print(r.row(peak, copy))
    report = {
        "device": name,
        "dtype": args.dtype,
        "shapes": asdict(shapes),
        "moe_shapes": asdict(moe_shapes),
        "theoretical_peak_gbps": peak,
        "copy_gbps": copy,
        "results": [
            {
                **asdict(r),
                "gbps": r.bytes / r.triton_ms / 1e6,
                "fraction_of_peak": r.bytes / r.triton_ms / 1e6 / peak if peak else None,
                "fraction_of_copy": r.bytes / r.triton_ms / 1e6 / copy,
                "speedup_vs_torch": r.torch_ms / r.triton_ms,
            }
            for r in results
        ],
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
