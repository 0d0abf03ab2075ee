"""Attention over a paged KV cache (no RoPE, GQA), Triton path (semantics: kernels/attention.py).

One flash-attention kernel serves decode and extend. A program owns one sequence, one block of
its queries and one KV head, and takes every query head of that KV head's group at once, so each
K/V tile is loaded once per group:

    rows of the (BLOCK_Q * REP_PAD, head_dim) query tile:  row r = (query r // REP_PAD,
    head kv_head * REP + r % REP_PAD); rows with r % REP_PAD >= REP or past q_len are masked.

Query i of sequence s sits at absolute position kv_len - q_len + i and sees keys 0..that
position; keys are gathered token by token through layout.kv_indices (token slots), so the page
size never matters. Online softmax in float32, float32 operands (TF32 tl.dot on a GPU).

Decode with few (sequence, KV head) pairs splits the keys across programs (flash-decoding):
each split writes an unnormalised partial output with its running max and sum, and
_combine_splits_kernel merges them. Read-only on the caches; no autotune.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionLayout
from kernels.backend import dot_precision


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
    scale, num_kv_heads, blocks_per_split,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0).to(tl.int64)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) % num_kv_heads
    split = tl.program_id(2) // num_kv_heads
    q_start = tl.load(query_start_ptr + s).to(tl.int64)
    q_len = tl.load(query_start_ptr + s + 1).to(tl.int64) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + s).to(tl.int64)

    r = tl.arange(0, BLOCK_Q * REP_PAD)
    qi = q_block * BLOCK_Q + r // REP_PAD
    head = kv_head * REP + r % REP_PAD
    row_ok = (qi < q_len) & (r % REP_PAD < REP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + qi)[:, None] * stride_q_t + head[:, None] * stride_q_h
        + d[None, :] * stride_q_d,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)
    q_pos = kv_len - q_len + qi  # absolute position of each query row

    # Keys this program visits: causal limit of its last query, cut to its split's range.
    key_end = tl.minimum(kv_len, kv_len - q_len + (q_block + 1) * BLOCK_Q)
    key_lo = split * blocks_per_split * BLOCK_N
    key_hi = tl.minimum(key_end, key_lo + blocks_per_split * BLOCK_N)
    m_i = tl.full((BLOCK_Q * REP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * REP_PAD,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q * REP_PAD, BLOCK_D), dtype=tl.float32)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < key_hi
        slot = tl.load(kv_indices_ptr + s * stride_kvi_s + n * stride_kvi_n, mask=n_ok, other=0)
        slot = slot.to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_k_t + kv_head * stride_k_h + d[None, :] * stride_k_d,
            mask=kv_mask, other=0.0,
        ).to(tl.float32)
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
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(probs, v, input_precision=DOT_PRECISION)
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


def _decode_splits(num_seqs: int, num_kv_heads: int, max_kv: int, block_n: int) -> int:
    """Key splits for decode: enough programs to fill a large GPU (~256), >= 4 key blocks each."""
    programs = num_seqs * num_kv_heads
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
    REP_PAD = triton.next_power_of_2(REP)
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    BLOCK_N = 64 if BLOCK_D <= 64 else 32
    decode = layout.max_q == 1
    rows = max(16, REP_PAD) if decode else max(64, REP_PAD)  # tl.dot needs >= 16 rows
    BLOCK_Q = rows // REP_PAD
    if num_splits is None:
        num_splits = _decode_splits(S, KVH, layout.max_kv, BLOCK_N) if decode else 1
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    blocks_per_split = triton.cdiv(triton.cdiv(max(layout.max_kv, 1), BLOCK_N), num_splits)
    if num_splits > 1:
        part_out = torch.empty(T, H, num_splits, BLOCK_D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(T, H, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_out = part_ml = out  # unused
    grid = (S, triton.cdiv(layout.max_q, BLOCK_Q), KVH * num_splits)
    # fmt: off
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_ml,
        layout.query_start_loc, layout.kv_lens, layout.kv_indices,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *layout.kv_indices.stride(),
        float(scale), KVH, blocks_per_split,
        H=H, HEAD_DIM=Dh, REP=REP, REP_PAD=REP_PAD, NUM_SPLITS=num_splits, BLOCK_Q=BLOCK_Q,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4 if BLOCK_D <= 64 else 8,
    )
    if num_splits > 1:
        _combine_splits_kernel[(T, H)](
            part_out, part_ml, out, *out.stride(),
            H=H, HEAD_DIM=Dh, NUM_SPLITS=num_splits, BLOCK_D=BLOCK_D, num_warps=4,
        )
    # fmt: on
    return out
