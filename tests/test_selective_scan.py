"""The Mamba1 selective scan (kernels/selective_scan.py): the torch path against the token-by-token
oracle (tests/oracles.py) over varlen batches resumed at any position, with true states at every
aligned chunk end; the C scan and decode step (kernels/cpu/mamba1.c) against the torch path; the
pool contract (slots read and written, padding rows only touch dummy slot 0)."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.cpu import mamba1 as cpu_mamba1
from baton.kernels.selective_scan import (
    selective_scan_pool,
    selective_scan_torch,
    selective_state_update,
    selective_state_update_torch,
)
from baton.kernels.ssd import build_chunk_layout
from tests.oracles import selective_scan_oracle

# (seq_lens, start positions, chunk size): fresh and resumed prompts, chunk ends inside and at
# the edges of the batch, a one-token prefill, odd widths below.
CASES = [
    ([7], [0], 4),
    ([5, 13, 1], [0, 3, 22], 4),
    ([9, 16], [16, 7], 8),
]


def inputs(seq_lens, width=6, d_state=5, gate=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, S = sum(seq_lens), len(seq_lens)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return dict(
        x=rand(T, width),
        dt=rand(T, width, scale=0.8) - 1.0,
        A=-torch.rand(width, d_state, generator=g) * 3 - 0.1,
        B=rand(T, d_state),
        C=rand(T, d_state),
        D=rand(width),
        dt_bias=rand(width, scale=0.3),
        z=rand(T, width) if gate else None,
        init=rand(S, width, d_state, scale=0.5),
    )


def scan_args(t):
    return t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], t["z"]


@pytest.mark.parametrize("gate", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("lens,starts,chunk", CASES)
def test_torch_scan_matches_oracle_and_emits_true_chunk_end_states(lens, starts, chunk, gate):
    t = inputs(lens, gate=gate)
    layout = build_chunk_layout(lens, starts, chunk, "cpu")
    out = selective_scan_torch(*scan_args(t), t["init"], layout)
    y, finals, per_token = selective_scan_oracle(*scan_args(t), t["init"], lens)
    torch.testing.assert_close(out.y.double(), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.final_states.double(), finals, atol=1e-5, rtol=1e-5)
    checked = 0
    for s, (n, start) in enumerate(zip(lens, starts)):
        for j in range(n):
            if (start + j + 1) % chunk == 0:  # the state at an absolute multiple of the chunk
                c = (start % chunk + j) // chunk
                torch.testing.assert_close(
                    out.chunk_states[s, c].double(), per_token[s][j], atol=1e-5, rtol=1e-5
                )
                checked += 1
        last = (start % chunk + n - 1) // chunk
        for c in range(last, layout.num_chunks):  # past the end: the final state
            torch.testing.assert_close(out.chunk_states[s, c], out.final_states[s])
    assert checked > 0 or lens == [7]


def pool_case(lens, starts, chunk, seed=1):
    t = inputs(lens, seed=seed)
    S = len(lens)
    pool = torch.randn(S + 3, *t["init"].shape[1:])
    slots = torch.tensor([S + 2 - s for s in range(S)])  # live slots, never 0, any order
    pool[slots] = t["init"]
    return t, pool, slots, build_chunk_layout(lens, starts, chunk, "cpu")


@pytest.mark.skipif(cpu_mamba1.library() is None, reason="no C compiler")
@pytest.mark.parametrize("lens,starts,chunk", CASES)
def test_c_scan_matches_torch_path_in_the_pool(lens, starts, chunk):
    t, pool, slots, layout = pool_case(lens, starts, chunk)
    ref_pool = pool.clone()
    ref = selective_scan_torch(*scan_args(t), ref_pool[slots], layout)
    ref_pool[slots] = ref.final_states
    assert cpu_mamba1.scan_supported(t["x"], pool)
    y, chunks = selective_scan_pool(*scan_args(t), pool, slots, layout, want_chunk_states=True)
    torch.testing.assert_close(y, ref.y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunks, ref.chunk_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)  # other slots untouched
    _, none = selective_scan_pool(*scan_args(t), pool, slots, layout, want_chunk_states=False)
    assert none is None


def decode_case(seed=2, width=7, d_state=5, batch=4):
    t = inputs([batch], width=width, d_state=d_state, seed=seed)
    pool = torch.randn(6, width, d_state)
    slots = torch.tensor([3, 0, 5, 0])  # rows 1 and 3 are padding on dummy slot 0
    return t, pool, slots


def test_torch_decode_step_matches_oracle_and_leaves_other_slots():
    t, pool, slots = decode_case()
    before = pool.clone()
    y = selective_state_update_torch(pool, *scan_args(t), slots)
    for row in (0, 2):  # the live rows: one token each, from their slot's state
        one = {k: v[row : row + 1] for k, v in t.items() if k in ("x", "dt", "B", "C", "z")}
        ref_y, ref_state, _ = selective_scan_oracle(
            *scan_args(t | one), before[slots[row]][None], [1]
        )
        torch.testing.assert_close(y[row].double(), ref_y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slots[row]].double(), ref_state[0], atol=1e-5, rtol=1e-5)
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.skipif(cpu_mamba1.library() is None, reason="no C compiler")
@pytest.mark.parametrize("gate", [True, False], ids=["gated", "ungated"])
def test_c_decode_step_matches_torch_path(gate):
    t, pool, slots = decode_case()
    if not gate:
        t["z"] = None
    ref_pool = pool.clone()
    ref = selective_state_update_torch(ref_pool, *scan_args(t), slots)
    y = selective_state_update(pool, *scan_args(t), slots)
    live = torch.tensor([0, 2])
    torch.testing.assert_close(y[live], ref[live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1:], ref_pool[1:], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_mamba1.library() is None, reason="no C compiler")
def test_c_kernels_refuse_a_slot_outside_the_pool_before_writing():
    t, pool, slots = decode_case()
    before = pool.clone()
    with pytest.raises(IndexError, match="slot index 9 of row 2"):
        selective_state_update(pool, *scan_args(t), torch.tensor([3, 0, 9, 0]))
    lens, starts = [3, 2], [0, 0]
    t = inputs(lens)
    with pytest.raises(IndexError, match="slot index 6"):
        selective_scan_pool(
            *scan_args(t), pool, torch.tensor([1, 6]), build_chunk_layout(lens, starts, 4, "cpu")
        )
    assert torch.equal(pool, before)
