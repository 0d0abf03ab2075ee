"""Rotary embeddings at the paged cache write (kernels/attention.py, kernels/triton/attention.py):
the torch path equals transformers' `apply_rotary_pos_emb`, the Triton kernel (interpreter,
fp32/fp16, tiny shapes) equals the torch path, the cache holds rotated keys, and attention over a
prompt computed as one extend equals the same prompt fed as extend + decode steps."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.attention import (
    build_attention_layout,
    paged_attention_torch,
    rotary_cos_sin,
    rotary_store_kv_torch,
)
from baton.kernels.triton.attention import paged_attention_triton, rotary_store_kv_triton


def inv_freq(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    # transformers' compute_default_rope_parameters
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponent)


def hf_rotary(q, k, positions, rotary_dim, dtype):
    """transformers' own rotary (Bamba's rotate-half with partial rotary) on (T, heads, Dh)."""
    from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb

    freqs = positions.float()[:, None] * inv_freq(rotary_dim)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # transformers' layout: (batch, heads, T, Dh) with cos (batch, T, rot)
    qh, kh = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_torch_rotary_equals_transformers_and_caches_rotated_keys(rotary_dim):
    g = torch.Generator().manual_seed(0)
    T, H, KVH, Dh = 7, 4, 2, 16
    q, k, v = (torch.randn(T, h, Dh, generator=g) for h in (H, KVH, KVH))
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 1000])
    cos, sin = rotary_cos_sin(positions, inv_freq(rotary_dim))
    k_cache, v_cache = torch.zeros(64, KVH, Dh), torch.zeros(64, KVH, Dh)
    slots = torch.tensor([5, 6, 7, 8, 20, 21, 63])
    q_rot = rotary_store_kv_torch(q, k, v, cos, sin, k_cache, v_cache, slots)
    want_q, want_k = hf_rotary(q, k, positions, rotary_dim, torch.float32)
    assert torch.equal(q_rot, want_q)
    assert torch.equal(k_cache[slots], want_k)
    assert torch.equal(v_cache[slots], v)
    if rotary_dim < Dh:  # partial rotary leaves the tail channels alone
        assert torch.equal(q_rot[..., rotary_dim:], q[..., rotary_dim:])
    assert not torch.allclose(q_rot[1:, :, :rotary_dim], q[1:, :, :rotary_dim])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_triton_rotary_store_matches_torch(dtype, rotary_dim):
    g = torch.Generator().manual_seed(1)
    T, H, KVH, Dh = 5, 4, 2, 16
    q, k, v = (torch.randn(T, h, Dh, generator=g).to(dtype) for h in (H, KVH, KVH))
    positions = torch.tensor([3, 4, 17, 250, 251])
    cos, sin = rotary_cos_sin(positions, inv_freq(rotary_dim))
    slots = torch.tensor([9, 10, 33, 2, 3])
    caches = [torch.zeros(40, KVH, Dh, dtype=dtype) for _ in range(4)]
    want_q = rotary_store_kv_torch(q, k, v, cos, sin, caches[0], caches[1], slots)
    got_q = rotary_store_kv_triton(q, k, v, cos, sin, caches[2], caches[3], slots)
    tol = 0 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[2], caches[0], atol=tol, rtol=tol)
    assert torch.equal(caches[3], caches[1])


def test_triton_rotary_refuses_bad_shapes():
    q = torch.zeros(3, 4, 16)
    k = v = torch.zeros(3, 2, 16)
    cos = sin = torch.zeros(3, 9)  # rotary_dim 18 > head_dim 16
    cache = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_store_kv_triton(q, k, v, cos, sin, cache, cache, torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extend_then_decode_equals_one_extend(backend):
    """A 9-token sequence: one extend of all 9 vs an extend of 6 then three decode steps. The
    decode steps read keys rotated at their own positions from the cache, so the last query's
    output must agree with the single extend's."""
    store = rotary_store_kv_torch if backend == "torch" else rotary_store_kv_triton
    attend = paged_attention_torch if backend == "torch" else paged_attention_triton
    g = torch.Generator().manual_seed(2)
    n, H, KVH, Dh, rot = 9, 4, 2, 16, 8
    q, k, v = (torch.randn(n, h, Dh, generator=g) for h in (H, KVH, KVH))
    freqs = inv_freq(rot)
    table = torch.arange(16, dtype=torch.int64).view(1, 16) + 16  # token slots 16..31

    def run(chunks):
        k_cache, v_cache = torch.zeros(48, KVH, Dh), torch.zeros(48, KVH, Dh)
        outs, start = [], 0
        for size in chunks:
            pos = torch.arange(start, start + size)
            cos, sin = rotary_cos_sin(pos, freqs)
            q_rot = store(q[pos], k[pos], v[pos], cos, sin, k_cache, v_cache, table[0, pos])
            layout = build_attention_layout([size], [start + size], table, "cpu")
            outs.append(attend(q_rot, k_cache, v_cache, layout, Dh**-0.5))
            start += size
        return torch.cat(outs), k_cache

    whole, cache_whole = run([n])
    split, cache_split = run([6, 1, 1, 1])
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_split, cache_whole, atol=0, rtol=0)
