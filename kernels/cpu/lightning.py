"""Lightning attention on the CPU (kernels/cpu/lightning.c), compiled once per machine into the
operator extension (kernels/cpu/extension.py): one threaded scan on pool slots (per (sequence,
head, block of 32 state columns), the block held in L1 across the tokens) for prefill, with
chunk-end states, and for decode rows; and the layer's fused decode step (SiLU, the step, the
output norm and gate in one call) on one rank. `BATON_CPU_OPS=0`, no compiler, a failed build or a
pool that is not contiguous float32 select the torch path (kernels/lightning.py), which agrees
to float32 rounding (tests/test_lightning.py).
"""

from __future__ import annotations

import torch

# one library, one pool contract: the gated delta rule's checks serve these kernels as they are
from baton.kernels.cpu.gated_delta import f32c, library, raise_bad_slot, supported
from baton.kernels.layouts import ChunkLayout

__all__ = [
    "lightning_decode_cpu",
    "lightning_layer_decode_cpu",
    "lightning_layer_decode_supported",
    "lightning_prefill_cpu",
    "supported",
]

MAX_HEAD_DIM = 256  # the fused step keeps a head's q, k and v on the stack


def _scan(q, k, v, decay, state_pool, slots, cu, start_pos, chunk, chunk_states, skip_padding):
    T, H, dk = q.shape
    dv = v.shape[-1]
    slots64 = slots.to(torch.int64).contiguous()
    o = torch.empty(T, H, dv, dtype=torch.float32)
    result = library().baton_lightning_scan(
        f32c(q), f32c(k), f32c(v), torch.exp(-decay.float()).contiguous(),
        state_pool, state_pool.shape[0], slots64, cu, start_pos, slots64.shape[0], chunk,
        chunk_states, chunk_states.shape[1] if chunk_states is not None else 0,
        int(skip_padding), o, H, dk, dv, torch.get_num_threads(),
    )  # fmt: skip
    raise_bad_slot(result, slots64, state_pool.shape[0], "lightning attention")
    return o.to(q.dtype)


def lightning_prefill_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/lightning.py's lightning_prefill_pool on the C scan: (o, chunk_states (num_seqs,
    num_chunks, H, dk, dv) float32); the final states are left in the pool."""
    H, dk, dv = state_pool.shape[1:]
    chunk_states = torch.empty(layout.num_seqs, layout.num_chunks, H, dk, dv)
    cu = layout.cu_seqlens.to(torch.int64).contiguous()
    start_pos = layout.start_pos.to(torch.int64).contiguous()
    o = _scan(q, k, v, decay, state_pool, slots, cu, start_pos, layout.chunk_size, chunk_states,
              skip_padding=False)  # fmt: skip
    return o, chunk_states


def lightning_decode_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """kernels/lightning.py's lightning_decode on the C scan; rows on the dummy slot 0 are
    padding (no read, no write, o = 0)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int64)
    return _scan(q, k, v, decay, state_pool, slots, cu, None, 0, None, skip_padding=True)


def lightning_layer_decode_supported(qkv: torch.Tensor, state_pool: torch.Tensor) -> bool:
    """CPU rows in float32 or bfloat16, heads of at most MAX_HEAD_DIM, the pool as the scan
    reads it."""
    return (
        qkv.dtype in (torch.float32, torch.bfloat16)
        and state_pool.shape[-1] <= MAX_HEAD_DIM
        and supported(qkv, state_pool)
    )


def lightning_layer_decode_cpu(
    qkv: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The lightning layer's decode step from its projections to out_proj's input
    (baton_lightning_decode), the pool updated in place: qkv (batch, 3 H d) qkv_proj's rows
    before the SiLU ([q_h | k_h | v_h] per head), gate (batch, H d) output_gate's rows before the
    sigmoid, norm_weight (H d), all in the model dtype with unit column stride; decay (H,)
    lambda. Rows on slot 0 are padding (nothing written, output 0). Returns (batch, H d) in the
    model dtype (engine/layers/lightning_attention.py's unfused path, to float32 rounding)."""
    batch = qkv.shape[0]
    H, d = state_pool.shape[1:3]
    for name, t, width in (("qkv", qkv, 3 * H * d), ("gate", gate, H * d)):
        if t.shape != (batch, width) or t.dtype != qkv.dtype or t.stride(1) != 1:
            raise ValueError(
                f"lightning_decode: {name} must be ({batch}, {width}) {qkv.dtype} rows with unit "
                f"column stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    if norm_weight.shape != (H * d,) or norm_weight.dtype != qkv.dtype:
        raise ValueError(f"lightning_decode: norm_weight must be ({H * d},) {qkv.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")  # fmt: skip
    slots64 = slots.to(torch.int64).contiguous()
    o = torch.empty(batch, H * d, dtype=torch.float32)
    out = torch.empty(batch, H * d, dtype=qkv.dtype)
    result = library().baton_lightning_decode(
        qkv, qkv.stride(0), gate, gate.stride(0), norm_weight.contiguous(),
        torch.exp(-decay.float()).contiguous(), state_pool, state_pool.shape[0], slots64, batch,
        eps, o, out, int(qkv.dtype == torch.bfloat16), H, d, torch.get_num_threads(),
    )  # fmt: skip
    if result < 0:
        raise ValueError(f"lightning_decode: head_dim {d} is over {MAX_HEAD_DIM}")
    raise_bad_slot(result, slots64, state_pool.shape[0], "lightning_decode")
    return out
