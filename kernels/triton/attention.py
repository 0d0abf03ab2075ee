"""Attention over a paged KV cache (GQA), Triton path (semantics: kernels/attention.py), and the
rotary cache write (`rotary_store_kv_triton`: rotate q and k, store k and v, one launch).

One flash-attention kernel serves decode and extend. A program owns one sequence, one block of
its queries and GROUP query heads that share a KV head:

    rows of the (BLOCK_Q * GROUP_PAD, head_dim) query tile:  row r = (query r // GROUP_PAD,
    head group * GROUP + r % GROUP_PAD); rows with r % GROUP_PAD >= GROUP or past q_len are
    masked.

Decode (one query per sequence) takes the whole GQA group (GROUP = heads per KV head), so each
K/V tile is loaded once per group and the 16-row minimum of tl.dot is filled by heads. Extend
takes one head per program (GROUP = 1) and 128 queries: prefill attention is compute-bound, and
packing a group of 5 heads into 8 rows would waste 3/8 of every product.

Query i of sequence s sits at absolute position kv_len - q_len + i and sees keys 0..that
position; keys are gathered token by token through layout.kv_indices (token slots), so the page
size never matters. Products take their operands in the cache's dtype (bf16/fp16 on the tensor
cores; float32 in IEEE precision, see baton.kernels.backend.dot_precision) and accumulate in float32;
the online softmax is float32 and its probabilities are rounded to the cache's dtype for the
P @ V product, as flash attention does.

Decode with few (sequence, head group) pairs splits the keys across programs (flash-decoding):
each split writes an unnormalised partial output with its running max and sum, and
_combine_splits_kernel merges them. Read-only on the caches; no autotune.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.backend import dot_precision
from baton.kernels.layouts import AttentionLayout


# fmt: off
@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    query_start_ptr, kv_lens_ptr, kv_indices_ptr,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_kvi_s, stride_kvi_n,
    scale, num_groups, blocks_per_split,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, REP: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0).to(tl.int64)
    q_block = tl.program_id(1)
    group = tl.program_id(2) % num_groups
    split = tl.program_id(2) // num_groups
    q_start = tl.load(query_start_ptr + s).to(tl.int64)
    q_len = tl.load(query_start_ptr + s + 1).to(tl.int64) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + s).to(tl.int64)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = q_block * BLOCK_Q + r // GROUP_PAD
    head = group * GROUP + r % GROUP_PAD
    kv_head = (group * GROUP) // REP  # GROUP divides REP: every row shares this KV head
    row_ok = (qi < q_len) & (r % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + qi)[:, None] * stride_q_t + head[:, None] * stride_q_h
        + d[None, :] * stride_q_d,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q_pos = kv_len - q_len + qi  # absolute position of each query row

    # Keys this program visits: causal limit of its last query, cut to its split's range.
    key_end = tl.minimum(kv_len, kv_len - q_len + (q_block + 1) * BLOCK_Q)
    key_lo = split * blocks_per_split * BLOCK_N
    key_hi = tl.minimum(key_end, key_lo + blocks_per_split * BLOCK_N)
    m_i = tl.full((BLOCK_Q * GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q * GROUP_PAD, BLOCK_D), dtype=tl.float32)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < key_hi
        slot = tl.load(kv_indices_ptr + s * stride_kvi_s + n * stride_kvi_n, mask=n_ok, other=0)
        slot = slot.to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_k_t + kv_head * stride_k_h + d[None, :] * stride_k_d,
            mask=kv_mask, other=0.0,
        ).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        scores = tl.where(visible, scores, -1.0e30)  # finite: no inf - inf on masked rows
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_v_t + kv_head * stride_v_h + d[None, :] * stride_v_d,
            mask=kv_mask, other=0.0,
        ).to(q.dtype)
        pv = tl.dot(probs.to(q.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + qi)[:, None] * stride_o_t + head[:, None] * stride_o_h
            + d[None, :] * stride_o_d,
            out.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        # Partials: (num_tokens, H, NUM_SPLITS, BLOCK_D) and (num_tokens, H, NUM_SPLITS, 2).
        part = ((q_start + qi) * H + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


# fmt: off
@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_ml_ptr, out_ptr,
    stride_o_t, stride_o_h, stride_o_d,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (t * H + h) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + part * 2)  # -inf for a split with no keys: weight 0 below
    lsum = tl.load(part_ml_ptr + part * 2 + 1)
    acc = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :])
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - m_max)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(lsum * weight, axis=0)
    tl.store(
        out_ptr + t * stride_o_t + h * stride_o_h + d * stride_o_d,
        out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM,
    )


def _decode_splits(num_seqs: int, num_groups: int, max_kv: int, block_n: int) -> int:
    """Key splits for decode: enough programs to fill a large GPU (~256), >= 4 key blocks each."""
    programs = num_seqs * num_groups
    by_occupancy = max(1, 256 // max(1, programs))
    by_length = max(1, triton.cdiv(max_kv, 4 * block_n))
    return min(16, triton.next_power_of_2(min(by_occupancy, by_length)))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of packed queries over their sequences' cached keys and values.

    q: (num_tokens, heads, head_dim) float32/float16/bfloat16 (their K/V already stored);
    k_cache, v_cache: (num_token_slots, kv_heads, head_dim), token slot = page * page_size +
    offset (page 0 is the dummy page); layout: query_start_loc (num_seqs + 1,) int32, kv_lens
    (num_seqs,) int32, kv_indices (num_seqs, max_kv) int64 token slots. Any strides.
    num_splits: key splits (a power of two); None picks 1 for extend and a few for decode.
    Returns (num_tokens, heads, head_dim) in q's dtype.
    """
    T, H, Dh = q.shape
    KVH = k_cache.shape[1]
    S = layout.num_seqs
    if k_cache.dim() != 3 or k_cache.shape[2] != Dh or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (num_token_slots, kv_heads, {Dh}), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if H % KVH:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {KVH}")
    if layout.query_start_loc.shape != (S + 1,) or layout.kv_lens.shape != (S,):
        raise ValueError("layout.query_start_loc must be (num_seqs + 1,) and kv_lens (num_seqs,)")
    if layout.kv_indices.dim() != 2 or layout.kv_indices.shape[0] != S:
        raise ValueError(f"layout.kv_indices must be (num_seqs, max_kv), got "
                         f"{tuple(layout.kv_indices.shape)}")
    tensors = (q, k_cache, v_cache, layout.query_start_loc, layout.kv_lens, layout.kv_indices)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("paged_attention_triton: all tensors must share one device")
    out = torch.empty(T, H, Dh, device=q.device, dtype=q.dtype)
    if T == 0 or S == 0:
        return out

    REP = H // KVH
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    decode = layout.max_q == 1
    if decode:  # the whole GQA group per program; tl.dot needs >= 16 rows
        GROUP = REP
        GROUP_PAD = triton.next_power_of_2(REP)
        BLOCK_Q = max(16, GROUP_PAD) // GROUP_PAD
        BLOCK_N = 64 if BLOCK_D <= 64 else 32
        num_warps, num_stages = (4 if BLOCK_D <= 64 else 8), 2
    else:  # one head per program, 128 queries (64 when head_dim > 128, for registers)
        GROUP = GROUP_PAD = 1
        BLOCK_Q = 128 if BLOCK_D <= 128 else 64
        BLOCK_N = 64 if BLOCK_D <= 128 else 32
        num_warps, num_stages = 8, 2
    num_groups = H // GROUP
    if num_splits is None:
        num_splits = _decode_splits(S, num_groups, layout.max_kv, BLOCK_N) if decode else 1
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    blocks_per_split = triton.cdiv(triton.cdiv(max(layout.max_kv, 1), BLOCK_N), num_splits)
    if num_splits > 1:
        part_out = torch.empty(T, H, num_splits, BLOCK_D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(T, H, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_out = part_ml = out  # unused
    grid = (S, triton.cdiv(layout.max_q, BLOCK_Q), num_groups * num_splits)
    # fmt: off
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_ml,
        layout.query_start_loc, layout.kv_lens, layout.kv_indices,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *layout.kv_indices.stride(),
        float(scale), num_groups, blocks_per_split,
        H=H, HEAD_DIM=Dh, REP=REP, GROUP=GROUP, GROUP_PAD=GROUP_PAD, NUM_SPLITS=num_splits,
        BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(T, H)](
            part_out, part_ml, out, *out.stride(),
            H=H, HEAD_DIM=Dh, NUM_SPLITS=num_splits, BLOCK_D=BLOCK_D, num_warps=4,
        )
    # fmt: on
    return out


# fmt: off
@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_cs_t, stride_cs_d,
    stride_qo_t, stride_qo_h, stride_qo_d,
    stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_t, stride_vc_h, stride_vc_d,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # fmt: on
    # One program per (token, head) of the H query heads followed by the KV heads.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    in_row = d < HEAD_DIM
    is_rot = d < 2 * HALF
    # rotate_half: channel d < HALF pairs with d + HALF (negated), d in [HALF, 2 HALF) with d - HALF
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    freq = tl.where(d < HALF, d, d - HALF)
    c = tl.load(cos_ptr + t * stride_cs_t + freq * stride_cs_d, mask=is_rot, other=1.0)
    s = tl.load(sin_ptr + t * stride_cs_t + freq * stride_cs_d, mask=is_rot, other=0.0)
    if head < H:
        base = q_ptr + t * stride_q_t + head * stride_q_h
        x = tl.load(base + d * stride_q_d, mask=in_row, other=0.0).to(tl.float32)
        p = tl.load(base + partner * stride_q_d, mask=in_row & is_rot, other=0.0).to(tl.float32)
        out = tl.where(is_rot, x * c + sign * p * s, x)
        dst = q_out_ptr + t * stride_qo_t + head * stride_qo_h + d * stride_qo_d
        tl.store(dst, out.to(q_out_ptr.dtype.element_ty), mask=in_row)
    else:
        kv_head = head - H
        slot = tl.load(slot_ptr + t).to(tl.int64)
        base = k_ptr + t * stride_k_t + kv_head * stride_k_h
        x = tl.load(base + d * stride_k_d, mask=in_row, other=0.0).to(tl.float32)
        p = tl.load(base + partner * stride_k_d, mask=in_row & is_rot, other=0.0).to(tl.float32)
        out = tl.where(is_rot, x * c + sign * p * s, x)
        dst = k_cache_ptr + slot * stride_kc_t + kv_head * stride_kc_h + d * stride_kc_d
        tl.store(dst, out.to(k_cache_ptr.dtype.element_ty), mask=in_row)
        val = tl.load(v_ptr + t * stride_v_t + kv_head * stride_v_h + d * stride_v_d, mask=in_row)
        dst = v_cache_ptr + slot * stride_vc_t + kv_head * stride_vc_h + d * stride_vc_d
        tl.store(dst, val.to(v_cache_ptr.dtype.element_ty), mask=in_row)


def rotary_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Shapes as baton.kernels.attention.rotary_store_kv. The rotation is computed in float32 and
    rounded once to the output dtype (the torch path rounds after each product, as transformers
    does: identical in float32, within one rounding in half precision)."""
    T, H, Dh = q.shape
    KVH = k.shape[1]
    half = cos.shape[1] if cos.dim() == 2 else -1
    if k.shape != (T, KVH, Dh) or v.shape != k.shape:
        raise ValueError(f"k and v must be (num_tokens, kv_heads, {Dh}) like q's tokens, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if cos.shape != (T, half) or sin.shape != cos.shape or not 0 < 2 * half <= Dh:
        raise ValueError(f"cos and sin must be (num_tokens, rotary_dim // 2) with rotary_dim <= "
                         f"{Dh}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if k_cache.shape[1:] != (KVH, Dh) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be (num_token_slots, {KVH}, {Dh})")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping must be ({T},), got {tuple(slot_mapping.shape)}")
    q_out = torch.empty_like(q)
    if T == 0:
        return q_out
    cos, sin = cos.float().contiguous(), sin.float().contiguous()  # one stride pair for both
    # fmt: off
    _rotary_store_kv_kernel[(T, H + KVH)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *q_out.stride(),
        *k_cache.stride(), *v_cache.stride(),
        H=H, HEAD_DIM=Dh, HALF=half, BLOCK_D=triton.next_power_of_2(Dh), num_warps=1,
    )
    # fmt: on
    return q_out
