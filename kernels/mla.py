"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi Linear, Bailing hybrid) over a paged
cache of latents, torch path.

The cache holds one row per token, not per head:

    latent row = [ c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim) ]
                   kv_a_layernorm(...)   the key part every head shares

while transformers expands every cached row into per-head keys and values,

    K_h = [ W_UK_h c_kv | k_rope ]      V_h = W_UV_h c_kv      (kv_b_proj = [W_UK_h; W_UV_h] per head)

Attention here is the "absorbed" form (DeepSeek-V2 paper, vLLM's and SGLang's MLA decode): the
query takes W_UK into the latent space, so every head attends over the shared latent rows as one
KV head (multi-query attention with keys of kv_lora_rank + rope and values of kv_lora_rank), and
W_UV takes each head's latent output back out (two batched matmuls per sequence, every head
and query of the sequence against its latent rows once: no per-head expansion of the cache):

    q_h . K_h = (W_UK_h^T q_nope_h) . c_kv + q_rope_h . k_rope
    o_h       = W_UV_h (sum_j p_hj c_kv_j)

the same sums in another order (fp32: ~1e-7 apart). On the CPU, when the C kernels are built,
the absorbed attention is the paged-attention kernel itself with one KV head (keys and values
both the latent rows): no gathered copy and no mask, so a captured decode step (engine/executor/
cpu_plan.py) reads each row's kv_len and not the padded capacity. The positions are NoPE in Kimi Linear (its
"rope" part is a shared key that is never rotated); a family with rotary (Bailing hybrid) rotates
q_rope and k_rope (`rotary_interleaved`) before they get here, so the pages hold rotated keys.
"""

from __future__ import annotations

import torch

from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.layouts import AttentionLayout


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary as transformers' apply_rotary_pos_emb_interleave computes it:
    x (num_tokens, heads, dim) rotated pairwise (x0, x1), (x2, x3)... by cos, sin (num_tokens,
    dim // 2) float32 (cast to x's dtype first), returned as [rotated evens | rotated odds]."""
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


def store_latent(latent_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor):
    """latent: (num_tokens, kv_lora_rank + rope) written at token slots `slot_mapping`
    (num_tokens,) of latent_cache (num_token_slots, kv_lora_rank + rope)."""
    latent_cache[slot_mapping] = latent.to(latent_cache.dtype)


def mla_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    layout: AttentionLayout,
    *,
    nope: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """q: (num_tokens, heads, nope + rope) packed queries (their latents already stored);
    latent_cache: (num_token_slots, kv_lora_rank + rope); w_kv_b: kv_b_proj's weight,
    (heads * (nope + v_head_dim), kv_lora_rank) (this rank's heads). Returns (num_tokens, heads,
    v_head_dim) in q's dtype."""
    T, H, qk = q.shape
    lora = w_kv_b.shape[1]
    if latent_cache.shape[-1] != lora + qk - nope:
        raise ValueError(
            f"mla_attention: latent rows of {latent_cache.shape[-1]} are not kv_lora_rank "
            f"{lora} + rope {qk - nope}"
        )
    w = w_kv_b.view(H, nope + v_head_dim, lora)
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    w_uk, w_uv = w[:, :nope].to(compute), w[:, nope:].to(compute)
    q_latent = torch.einsum("thn,hnl->thl", q[..., :nope].to(compute), w_uk)
    q_abs = torch.cat([q_latent, q[..., nope:].to(compute)], dim=-1)  # (T, H, lora + rope)
    if latent_attention_on_cpu(latent_cache):
        o_latent = _latent_attention_cpu(q_abs, latent_cache, layout, scale)[..., :lora]
        return torch.einsum("thl,hvl->thv", o_latent.to(compute), w_uv).to(q.dtype)
    S, Q, K = layout.num_seqs, layout.max_q, layout.max_kv
    padded = torch.cat([q_abs, q_abs.new_zeros(1, H, q_abs.shape[-1])])[layout.slot_q]
    padded = padded.view(S, Q * H, -1)  # (S, Q H, lora + rope): every head of every query
    keys = latent_cache.index_select(0, layout.kv_indices.reshape(-1)).to(compute)
    keys = keys.view(S, K, -1)  # one KV head shared by every query head: no per-head copies
    scores = torch.bmm(padded, keys.transpose(1, 2)).view(S, Q, H, K) * scale
    # a padded query row sees no key: a finite floor keeps its (discarded) softmax finite
    scores = scores.masked_fill(~layout.mask.view(S, Q, 1, K), torch.finfo(compute).min)
    probs = torch.softmax(scores, dim=-1).view(S, Q * H, K)
    out = torch.bmm(probs, keys[..., :lora])  # (S, Q H, lora)
    o_latent = out.view(S * Q, H, lora)[layout.q_slot]
    return torch.einsum("thl,hvl->thv", o_latent, w_uv).to(q.dtype)


def latent_attention_on_cpu(latent_cache: torch.Tensor) -> bool:
    """Whether mla_attention runs on the C kernels for this cache (else the torch path, which
    reads the layout's mask)."""
    return cpu_ops.decode_attention_supported(latent_cache[:1, None], latent_cache)


def _latent_attention_cpu(
    q_abs: torch.Tensor, latent_cache: torch.Tensor, layout: AttentionLayout, scale: float
) -> torch.Tensor:
    """The absorbed attention on the C paged-attention kernels (kernels/cpu/ops.c): one KV head
    whose keys and values are both the latent rows (the values' rope columns are computed and
    dropped), read straight from the pages up to each row's kv_len, no mask. Returns (T, H,
    lora + rope) in the cache's dtype."""
    T = q_abs.shape[0]
    cache = latent_cache.view(latent_cache.shape[0], 1, -1)
    q = q_abs.to(latent_cache.dtype)
    if layout.max_q == 1 and T == layout.num_seqs:
        return cpu_ops.decode_attention_cpu(
            q, cache, cache, layout.kv_indices, layout.kv_lens, scale
        )
    return cpu_ops.extend_attention_cpu(
        q, cache, cache, layout.kv_indices, layout.kv_lens, layout.query_start_loc, scale
    )
