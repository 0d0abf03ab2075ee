"""The C gated delta rule (kernels/cpu/gated_delta.c) against the torch path and the oracle."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.cpu import gated_delta as cpu_gated_delta
from baton.kernels.cpu.extension import PORTABLE_FLAGS
from baton.kernels.gated_delta import (
    chunk_gated_delta_rule_torch,
    gated_delta_decode,
    gated_delta_decode_torch,
    gated_delta_prefill,
)
from baton.kernels.ssd import build_chunk_layout
from tests.oracles import gated_delta_oracle
from tests.test_gated_delta import CASES, gdn_inputs

pytestmark = pytest.mark.skipif(
    cpu_gated_delta.library() is None, reason="no C compiler: the torch path serves"
)


def pool_with(init: torch.Tensor, slots: list[int], num_slots: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_slots, *init.shape[1:], generator=gen)
    pool[slots] = init
    return pool


# CASES' head dims stay under one 32-column block (the portable loop); here full blocks too.
C_CASES = CASES + [([50, 20], [7, 0], 16, (2, 4, 32, 72))]


@pytest.mark.parametrize("seq_lens,start_pos,chunk,dims", C_CASES)
def test_c_prefill_matches_torch_path_and_oracle(seq_lens, start_pos, chunk, dims):
    Hk, Hv, dk, dv = dims
    q, k, v, g, beta, init = gdn_inputs(seq_lens, Hk, Hv, dk, dv)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    slots = list(range(2, 2 + len(seq_lens)))
    pool = pool_with(init, slots, len(seq_lens) + 3)
    before = pool.clone()
    o, chunk_states = cpu_gated_delta.gated_delta_prefill_cpu(
        q, k, v, g, beta, pool, torch.tensor(slots), layout, True
    )
    ref = chunk_gated_delta_rule_torch(q, k, v, g, beta, init, layout)
    o_oracle, final_oracle, _ = gated_delta_oracle(q, k, v, g, beta, init, seq_lens)
    torch.testing.assert_close(o, ref.o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(o.double(), o_oracle, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool[slots].double(), final_oracle, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunk_states, ref.chunk_states, atol=2e-5, rtol=1e-4)
    for untouched in set(range(pool.shape[0])) - set(slots):
        assert torch.equal(pool[untouched], before[untouched])


def test_c_prefill_without_chunk_states_leaves_the_same_pool():
    seq_lens, start_pos = [12, 30], [3, 0]
    q, k, v, g, beta, init = gdn_inputs(seq_lens, seed=4)
    layout = build_chunk_layout(seq_lens, start_pos, 8, "cpu")
    with_states, without = pool_with(init, [1, 2], 3), pool_with(init, [1, 2], 3)
    idx = torch.tensor([1, 2])
    o1, cs = cpu_gated_delta.gated_delta_prefill_cpu(
        q, k, v, g, beta, with_states, idx, layout, True
    )
    o2, none = cpu_gated_delta.gated_delta_prefill_cpu(
        q, k, v, g, beta, without, idx, layout, False
    )
    assert none is None and cs.shape == (2, layout.num_chunks, 4, 8, 6)
    assert torch.equal(o1, o2) and torch.equal(with_states, without)


@pytest.mark.parametrize("dims", [(2, 4, 8, 6), (1, 3, 5, 40), (2, 2, 64, 64)])
def test_c_decode_matches_torch_path_and_skips_padding(dims):
    Hk, Hv, dk, dv = dims
    q, k, v, g, beta, _ = gdn_inputs([4], Hk, Hv, dk, dv, seed=6)
    pool = torch.randn(6, Hv, dk, dv, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([5, 0, 2, 3])
    c_pool, torch_pool = pool.clone(), pool.clone()
    o_c = cpu_gated_delta.gated_delta_decode_cpu(q, k, v, g, beta, c_pool, slots)
    o_t = gated_delta_decode_torch(q, k, v, g, beta, torch_pool, slots)
    torch.testing.assert_close(o_c, o_t, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(c_pool, torch_pool, atol=2e-5, rtol=1e-4)
    assert torch.equal(o_c[1], torch.zeros_like(o_c[1]))
    for untouched in (0, 1, 4):
        assert torch.equal(c_pool[untouched], pool[untouched])


def test_c_decode_half_inputs_match_torch_path():
    q, k, v, g, beta, _ = gdn_inputs([3], dtype=torch.bfloat16, seed=8)
    pool = torch.randn(4, 4, 8, 6)
    c_pool, torch_pool = pool.clone(), pool.clone()
    slots = torch.tensor([1, 2, 3])
    o_c = cpu_gated_delta.gated_delta_decode_cpu(q, k, v, g, beta, c_pool, slots)
    o_t = gated_delta_decode_torch(q, k, v, g, beta, torch_pool, slots)
    assert o_c.dtype == torch.bfloat16
    torch.testing.assert_close(o_c.float(), o_t.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(c_pool, torch_pool, atol=2e-5, rtol=1e-4)


def test_bad_slot_is_an_error_and_writes_nothing():
    q, k, v, g, beta, init = gdn_inputs([5, 3], seed=10)
    pool = torch.randn(3, 4, 8, 6)
    before = pool.clone()
    layout = build_chunk_layout([5, 3], [0, 0], 4, "cpu")
    with pytest.raises(IndexError, match="slot index 7 of row 1 is outside the pool of 3"):
        cpu_gated_delta.gated_delta_prefill_cpu(
            q, k, v, g, beta, pool, torch.tensor([1, 7]), layout, True
        )
    with pytest.raises(IndexError, match="slot index -1 of row 0"):
        cpu_gated_delta.gated_delta_decode_cpu(
            q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([-1, 1])
        )
    assert torch.equal(pool, before)


def test_public_functions_run_the_c_path_and_fall_back_to_torch(monkeypatch):
    seq_lens = [6, 9]
    q, k, v, g, beta, init = gdn_inputs(seq_lens, seed=12)
    layout = build_chunk_layout(seq_lens, [1, 0], 4, "cpu")
    idx = torch.tensor([1, 2])
    calls = []
    for name in ("gated_delta_prefill_cpu", "gated_delta_decode_cpu"):
        real = getattr(cpu_gated_delta, name)
        monkeypatch.setattr(
            cpu_gated_delta,
            name,
            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a),
        )
    results = []
    for built in (True, False):
        if not built:
            monkeypatch.setattr(cpu_gated_delta, "library", lambda: None)
        pool = pool_with(init, [1, 2], 3)
        o, cs = gated_delta_prefill(q, k, v, g, beta, pool, idx, layout, True)
        o_dec = gated_delta_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, idx)
        results.append((o, cs, o_dec, pool))
    assert calls == ["gated_delta_prefill_cpu", "gated_delta_decode_cpu"]
    for c_result, torch_result in zip(*results):
        torch.testing.assert_close(c_result, torch_result, atol=2e-5, rtol=1e-4)


def test_plain_c_build_without_avx512_agrees(tmp_path, monkeypatch):
    """The portable loops (-march=x86-64-v3: what a CPU without AVX-512 compiles) give the same
    prefill and decode as the intrinsics build the rest of this file tests."""
    from baton.kernels.cpu import extension

    portable = extension.variant(PORTABLE_FLAGS, "baton_portable")
    assert portable is not None
    native = cpu_gated_delta.library()
    seq_lens, dims = [40, 3], (2, 4, 24, 70)  # 70 columns: two full blocks of 32 and a tail
    q, k, v, g, beta, init = gdn_inputs(seq_lens, *dims, seed=14)
    layout = build_chunk_layout(seq_lens, [5, 0], 16, "cpu")
    results = []
    for lib in (portable, native):
        monkeypatch.setattr(cpu_gated_delta, "library", lambda lib=lib: lib)
        pool = pool_with(init, [1, 2], 3)
        o, chunk_states = cpu_gated_delta.gated_delta_prefill_cpu(
            q, k, v, g, beta, pool, torch.tensor([1, 2]), layout, True
        )
        o_dec = cpu_gated_delta.gated_delta_decode_cpu(
            q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([2, 1])
        )
        results.append((o, chunk_states, o_dec, pool))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    o_ref, _, _ = gated_delta_oracle(q, k, v, g, beta, init, seq_lens)
    torch.testing.assert_close(results[0][0].double(), o_ref, atol=2e-5, rtol=1e-4)
