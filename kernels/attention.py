"""Attention over a paged KV cache (GQA; rotary embeddings applied at the cache write), torch path.

Rotary embeddings (NeoX / "rotate half" form, as transformers' Llama, Bamba, Granite, Zamba2):
`rotary_store_kv` rotates the first `rotary_dim` channels of every query and key head at its
absolute position and writes the rotated keys into the cache, so the cache holds rotated K and
attention never needs positions again; decode and extend read the same cached keys.

KV cache per attention layer: k_cache, v_cache (num_token_slots, kv_heads, head_dim); token slot
= page * page_size + offset. Page 0 is the dummy page that padded rows point at.

One function serves decode (one query per sequence) and extend (a chunk of queries over the
cached prefix plus themselves, causal). On the CPU both run C kernels that read the paged cache
in place (kernels/cpu/ops.c); without them (no compiler, `BATON_CPU_OPS=0`, other dtypes) the
torch path pads queries to (num_seqs, max_q) and gathers each sequence's keys to
(num_seqs, max_kv) once per call, then runs one SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.layouts import AttentionLayout
from baton.kernels.workspace import scratch


def build_attention_layout(
    q_lens: list[int],
    kv_lens: list[int],
    kv_indices: torch.Tensor,
    device: torch.device | str,
    kv_width: int | None = None,
) -> AttentionLayout:
    """q_lens / kv_lens: host lists; kv_indices: (num_seqs, >= max(kv_lens)) int64 token slots.
    `kv_width` fixes max_kv (static shapes for CUDA graphs); default: the longest sequence."""
    num_seqs = len(q_lens)
    max_q, max_kv = max(q_lens, default=0), max(kv_lens, default=0)
    if kv_width is not None:
        if kv_width < max_kv:
            raise ValueError(f"kv_width {kv_width} is shorter than the longest sequence ({max_kv})")
        max_kv = kv_width
    ql = torch.tensor(q_lens, dtype=torch.int64)
    kl = torch.tensor(kv_lens, dtype=torch.int64)
    num_tokens = int(ql.sum())
    seq_of_q = torch.repeat_interleave(torch.arange(num_seqs), ql)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(ql, 0)
    local = torch.arange(num_tokens) - cu[:-1][seq_of_q]
    q_slot = seq_of_q * max_q + local
    slot_q = torch.full((num_seqs * max_q,), num_tokens, dtype=torch.int64)
    slot_q[q_slot] = torch.arange(num_tokens)
    # Query i of seq s sits at absolute position kv_len - q_len + i and sees keys 0..that.
    q_pos = (kl - ql)[:, None] + torch.arange(max_q)[None, :]
    key_pos = torch.arange(max_kv)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    mask &= key_pos[None, None, :] < kl[:, None, None]
    if max_kv:
        mask[:, :, 0] = True  # empty (padding) query rows must not be all -inf
    return AttentionLayout(
        num_seqs=num_seqs,
        max_q=max_q,
        max_kv=max_kv,
        query_start_loc=cu.to(device=device, dtype=torch.int32),
        kv_lens=kl.to(device=device, dtype=torch.int32),
        kv_indices=kv_indices[:, :max_kv].to(device),
        q_slot=q_slot.to(device),
        slot_q=slot_q.to(device),
        mask=mask.unsqueeze(1).to(device),
    )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: (num_tokens, kv_heads, head_dim) written at token slots `slot_mapping` (num_tokens,)."""
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (num_tokens,) int64; inv_freq: (rotary_dim // 2,) float32.
    Returns cos, sin: (num_tokens, rotary_dim // 2) float32 (the angle product is computed as
    transformers does, position times frequency in float32, so both see the same angles)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim); cos, sin:
    (num_tokens, rotary_dim // 2) float32 with rotary_dim <= head_dim. Rotates the first
    rotary_dim channels of q and k, stores the rotated k and v at `slot_mapping`; returns the
    rotated q (a new tensor; the inputs are not modified)."""
    if select_backend(q) == "triton":
        from baton.kernels.triton.attention import rotary_store_kv_triton

        return rotary_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rotary_store_kv_torch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, heads, head_dim). transformers' `x * cos + rotate_half(x) * sin` on the
    first 2 * cos.shape[1] channels, in x's dtype (cos/sin are cast to it first, as there)."""
    half = cos.shape[1]
    c = torch.cat([cos, cos], dim=-1).to(x.dtype)[:, None, :]
    s = torch.cat([sin, sin], dim=-1).to(x.dtype)[:, None, :]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * c + rotated * s, rest], dim=-1)


def rotary_store_kv_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
    if contiguous and cpu_ops.rotary_store_supported(q, k, v, k_cache, cos):
        # one C pass (kernels/cpu/ops.c) instead of ~20 operators a layer: the same roundings
        return cpu_ops.rotary_store_kv_cpu(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    store_kv(k_cache, v_cache, apply_rotary_torch(k, cos, sin), v, slot_mapping)
    return apply_rotary_torch(q, cos, sin)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
) -> torch.Tensor:
    """q: (num_tokens, heads, head_dim) packed queries (their K/V already stored). Returns like q."""
    if select_backend(q) == "triton":
        from baton.kernels.triton.attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, layout, scale)
    return paged_attention_torch(q, k_cache, v_cache, layout, scale)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
) -> torch.Tensor:
    num_tokens, H, Dh = q.shape
    S, Q = layout.num_seqs, layout.max_q
    if cpu_ops.decode_attention_supported(q, k_cache):
        # Straight from the paged cache, no gathered copy, no mask (kernels/cpu/ops.c): one
        # query per sequence (decode) or each sequence's causal chunk (extend).
        if Q == 1 and num_tokens == S:
            return cpu_ops.decode_attention_cpu(
                q, k_cache, v_cache, layout.kv_indices, layout.kv_lens, scale
            )
        return cpu_ops.extend_attention_cpu(
            q, k_cache, v_cache, layout.kv_indices, layout.kv_lens, layout.query_start_loc, scale
        )
    qp = torch.cat([q, q.new_zeros(1, H, Dh)])[layout.slot_q].view(S, Q, H, Dh).transpose(1, 2)
    flat = layout.kv_indices.reshape(-1)
    shape = (S, layout.max_kv, *k_cache.shape[1:])
    # Gathered keys/values go to reused buffers: a fresh (S, max_kv, ...) tensor per layer and
    # step costs more in page faults than the attention itself on the CPU.
    k = torch.index_select(
        k_cache, 0, flat, out=scratch("attn_k", shape, k_cache.dtype, q.device).view(-1, *shape[2:])
    )
    v = torch.index_select(
        v_cache, 0, flat, out=scratch("attn_v", shape, v_cache.dtype, q.device).view(-1, *shape[2:])
    )
    # The CPU's reduced-precision SDPA is ~5x slower than float32 for one query per sequence
    # (decode); upcasting the gathered keys/values costs a fraction of that.
    compute = torch.float32 if Q == 1 and q.device.type == "cpu" else q.dtype
    k = k.view(shape).to(compute).transpose(1, 2)  # (S, KVH, K, Dh)
    v = v.view(shape).to(compute).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qp.to(compute), k, v, attn_mask=layout.mask, scale=scale, enable_gqa=H != k.shape[1]
    )  # (S, H, Q, Dh)
    return out.to(q.dtype).transpose(1, 2).reshape(S * Q, H, Dh)[layout.q_slot]
