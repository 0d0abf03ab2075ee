"""The C rotary + K/V store (kernels/cpu/ops.c baton_rotary_store_kv) against the torch path it
replaces (kernels/attention.py apply_rotary_torch + store_kv): bit-identical rotated q, k rows and
v rows at their slots, float32 and bfloat16, whole and partial rotary, q/k/v as strided views of
one fused projection (as the attention layers hand them over), nothing else in the caches
touched."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import attention
from baton.kernels.attention import apply_rotary_torch, rotary_cos_sin, rotary_store_kv, store_kv
from baton.kernels.cpu import ops as cpu_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])  # whole heads, the first half of each head
def test_c_rotary_store_is_the_torch_path_bit_for_bit(monkeypatch, dtype, rotary_dim):
    T, H, KVH, Dh, slots = 37, 6, 2, 64, 64
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(T, (H + 2 * KVH) * Dh + 5, generator=g).to(dtype)
    q, k, v, _ = fused.split([H * Dh, KVH * Dh, KVH * Dh, 5], dim=-1)
    q, k, v = q.view(T, H, Dh), k.view(T, KVH, Dh), v.view(T, KVH, Dh)
    positions = torch.randint(0, 4000, (T,), generator=g)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = rotary_cos_sin(positions, inv_freq)
    slot_mapping = torch.randperm(slots, generator=g)[:T]
    if not cpu_ops.rotary_store_supported(q, k, v, torch.empty(0, KVH, Dh, dtype=dtype), cos):
        pytest.skip("the C kernels are not built here")
    caches = [torch.full((slots, KVH, Dh), 7.0, dtype=dtype) for _ in range(4)]
    calls = []
    fast = cpu_ops.rotary_store_kv_cpu
    monkeypatch.setattr(cpu_ops, "rotary_store_kv_cpu", lambda *a: calls.append(1) or fast(*a))
    got_q = rotary_store_kv(q, k, v, cos, sin, caches[0], caches[1], slot_mapping)
    assert calls == [1]
    store_kv(caches[2], caches[3], apply_rotary_torch(k, cos, sin), v, slot_mapping)
    want_q = apply_rotary_torch(q, cos, sin)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert (caches[0][untouched] == 7.0).all()


def test_c_rotary_store_refuses_a_slot_outside_the_caches():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos, sin = rotary_cos_sin(torch.arange(2), torch.ones(4))
    k_cache, v_cache = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    if not cpu_ops.rotary_store_supported(q, k, k, k_cache, cos):
        pytest.skip("the C kernels are not built here")
    with pytest.raises(IndexError, match="outside the pool"):
        attention.rotary_store_kv(q, k, k, cos, sin, k_cache, v_cache, torch.tensor([1, 4]))
    assert (k_cache == 0).all()
