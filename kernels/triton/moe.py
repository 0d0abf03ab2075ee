"""Fused MoE experts in Triton: (token, choice) pairs sorted into per-expert blocks, a grouped
GEMM over the blocks for the up projection with the activation fused (relu² for NemotronH's
ungated experts, SwiGLU for gated ones such as Granite-4.0-H's), a second grouped GEMM for the
down projection with the routing weight applied, and a float32 sum over the k choices.

Everything stays on the device and every shape depends only on (T, k, E): no host sync for the
per-expert counts, so a CUDA graph captures a decode step through it. Blocks past the last
expert's are marked -1 and exit at once.

    pairs (T*k) ──sort by expert, pad each expert to BLOCK_M──> sorted_pairs (P,), block_expert (P/BLOCK_M,)
    up kernel:   grid (P/BLOCK_M, cdiv(I, BLOCK_N))   h[pair] = act(x[pair // k] @ W_up[e]ᵀ)
    down kernel: grid (P/BLOCK_M, cdiv(D, BLOCK_N))   y[pair] = w[pair] * (h[pair] @ W_down[e]ᵀ)
    out = y.view(T, k, D).sum(1)

Shapes as in kernels/moe.py; a quantized stack (kernels/quant.py) is decoded in the weight tiles
by kernels/triton/quant.py's `load_weight_tile` (weight-only). No autotune (a single config; the interpreter refuses several).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.backend import dot_precision
from baton.kernels.layouts import Activation, Routing
from baton.kernels.lora import ExpertDeltas
from baton.kernels.quant import QuantizedTensor
from baton.kernels.triton.quant import FORMAT_PLAIN, FORMATS, load_weight_tile


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the flattened (token, choice) pairs by expert into BLOCK_M-padded runs.

    ids: (T, k) -> sorted_pairs (P,) int32 (pair index, or T*k for padding),
    block_expert (P // block_m,) int32 (the expert of each block, -1 past the last run).
    P = round_up(T*k + E*(block_m - 1), block_m) bounds every padding, so no shape depends on
    the counts."""
    flat = ids.flatten()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # torch.bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    total = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((total,), n, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _moe_up_kernel(
    x_ptr,  # (T, D)
    w_ptr,  # (E, R, D), R = I (relu2) or 2I (swiglu: gate rows, then up rows); or its codes
    scale_ptr,  # quantized: (E, R, SCALE_COLS) scales (kernels/triton/quant.py), else unused
    global_ptr,  # NVFP4: (E, R) global scales, else unused
    h_ptr,  # (T*k, I)
    delta_ptr,  # HAS_DELTA: (T*k, ROWS) float32, each pair's adapter delta (kernels/lora.py)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    D,
    INTER,
    ROWS,  # rows of one expert's w: INTER, or 2 * INTER for SwiGLU
    W_STRIDE,  # elements of w per expert (codes: halved for NVFP4)
    SCALE_COLS,
    GROUP,
    TOP_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    FORMAT: tl.constexpr,  # triton_quant's FORMAT_PLAIN / FP8 / NVFP4
    HAS_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    tokens = pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * W_STRIDE
    scale_base = scale_ptr + expert.to(tl.int64) * ROWS * SCALE_COLS
    global_base = global_ptr + expert.to(tl.int64) * ROWS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < D
        a = tl.load(
            x_ptr + tokens[:, None].to(tl.int64) * D + kk[None, :],
            mask=valid[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = load_weight_tile(
            w_base,
            scale_base,
            global_base,
            offs_n,
            kk,
            mask_n,
            mask_k,
            D,
            SCALE_COLS,
            GROUP,
            FORMAT,
        )
        acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION)
        if SWIGLU:
            b_up = load_weight_tile(
                w_base,
                scale_base,
                global_base,
                offs_n + INTER,
                kk,
                mask_n,
                mask_k,
                D,
                SCALE_COLS,
                GROUP,
                FORMAT,
            )
            acc_up += tl.dot(a, b_up.to(a.dtype), input_precision=PRECISION)
    if HAS_DELTA:  # the pair's adapter, before the activation
        delta_rows = delta_ptr + pairs[:, None].to(tl.int64) * ROWS + offs_n[None, :]
        mask = valid[:, None] & mask_n[None, :]
        acc += tl.load(delta_rows, mask=mask, other=0.0)
        if SWIGLU:
            acc_up += tl.load(delta_rows + INTER, mask=mask, other=0.0)
    if SWIGLU:
        h = acc * tl.sigmoid(acc) * acc_up
    else:
        h = tl.maximum(acc, 0.0)
        h = h * h
    tl.store(
        h_ptr + pairs[:, None].to(tl.int64) * INTER + offs_n[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=valid[:, None] & mask_n[None, :],
    )


@triton.jit
def _moe_down_kernel(
    h_ptr,  # (T*k, I)
    w_ptr,  # (E, D, I) or its codes
    scale_ptr,  # quantized: (E, D, SCALE_COLS)
    global_ptr,  # NVFP4: (E, D)
    weights_ptr,  # (T*k,) float32
    y_ptr,  # (T*k, D) float32
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    D,
    INTER,
    W_STRIDE,
    SCALE_COLS,
    GROUP,
    FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * W_STRIDE
    scale_base = scale_ptr + expert.to(tl.int64) * D * SCALE_COLS
    global_base = global_ptr + expert.to(tl.int64) * D
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < INTER
        a = tl.load(
            h_ptr + pairs[:, None].to(tl.int64) * INTER + kk[None, :],
            mask=valid[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = load_weight_tile(
            w_base,
            scale_base,
            global_base,
            offs_n,
            kk,
            mask_n,
            mask_k,
            INTER,
            SCALE_COLS,
            GROUP,
            FORMAT,
        )
        acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
    tl.store(
        y_ptr + pairs[:, None].to(tl.int64) * D + offs_n[None, :],
        acc * weight[:, None],
        mask=valid[:, None] & mask_n[None, :],
    )


def _blocks(num_pairs: int, width: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small M for decode-sized batches (few pairs per expert),
    larger for prefill; tl.dot needs at least 16 on a GPU."""
    block_m = 16 if num_pairs <= 512 else 64
    block_n = 64 if width >= 64 else 16
    return block_m, block_n, 64


def _weight_args(w: torch.Tensor | QuantizedTensor) -> tuple:
    """(codes or values, scales, global scales, elements per expert, scale columns, group,
    format) for a kernel: a plain stack's own tensor stands in for the unused pointers."""
    if not isinstance(w, QuantizedTensor):
        w = w.contiguous()
        return w, w, w, w[0].numel(), 0, 1, FORMAT_PLAIN
    data = w.data.contiguous()
    scale = w.scale.contiguous() if w.format == "nvfp4" else w.scale.float().contiguous()
    global_scale = w.global_scale.contiguous() if w.global_scale is not None else scale
    return data, scale, global_scale, data[0].numel(), scale.shape[-1], w.group, FORMATS[w.format]


def fused_moe_triton(
    x: torch.Tensor,
    w_up: torch.Tensor | QuantizedTensor,
    w_down: torch.Tensor | QuantizedTensor,
    routing: Routing,
    activation: Activation,
    lora: ExpertDeltas | None = None,
) -> torch.Tensor:
    """Same contract as baton.kernels.moe.fused_moe_torch; quantized stacks are decoded in the tiles
    (weight-only, kernels/triton/quant.py). Expert adapters: each pair's up delta (the batched
    LoRA kernels, kernels/lora.py) enters the up kernel before the activation, the down delta of
    its h is added to its weighted output."""
    T, D = x.shape
    E, inter = w_down.shape[0], w_down.shape[2]
    up_rows = w_up.shape[1]
    k = routing.ids.shape[1]
    if T == 0:
        return x.new_zeros(0, D)
    num_pairs = T * k
    x = x.contiguous()
    up_args, down_args = _weight_args(w_up), _weight_args(w_down)
    weights = routing.weights.float().contiguous().flatten()
    block_m, block_n, block_k = _blocks(num_pairs, inter)
    sorted_pairs, block_expert = align_pairs(routing.ids, E, block_m)
    num_blocks = block_expert.shape[0]
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    if lora is not None:
        pair_slots = lora.pair_slots(routing.ids)
        up_delta = lora.up_delta(x, pair_slots, k)
    _moe_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        *up_args[:3],
        h,
        up_delta if lora is not None else h,
        sorted_pairs,
        block_expert,
        num_pairs,
        D,
        inter,
        up_rows,
        *up_args[3:6],
        TOP_K=k,
        SWIGLU=activation == "swiglu",
        FORMAT=up_args[6],
        HAS_DELTA=lora is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
    )
    y = torch.empty(num_pairs, D, dtype=torch.float32, device=x.device)
    block_n_down = 64 if D >= 64 else 16
    _moe_down_kernel[(num_blocks, triton.cdiv(D, block_n_down))](
        h,
        *down_args[:3],
        weights,
        y,
        sorted_pairs,
        block_expert,
        num_pairs,
        D,
        inter,
        *down_args[3:6],
        FORMAT=down_args[6],
        BLOCK_M=block_m,
        BLOCK_N=block_n_down,
        BLOCK_K=block_k,
        PRECISION=precision,
    )
    if lora is not None:
        delta = torch.zeros_like(y)
        lora.down_delta(h, pair_slots, delta)
        y.addcmul_(weights[:, None], delta)
    return y.view(T, k, D).sum(dim=1).to(x.dtype)
