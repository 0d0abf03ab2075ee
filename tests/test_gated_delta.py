"""The gated delta rule's torch path (kernels/gated_delta.py) against the float64 token-by-token
oracle and against transformers' own reference functions."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.gated_delta import (
    chunk_gated_delta_rule_torch,
    gated_delta_decode_torch,
    gdn_gating,
)
from baton.kernels.ssd import build_chunk_layout
from tests.oracles import gated_delta_oracle


def gdn_inputs(seq_lens, Hk=2, Hv=4, dk=8, dv=6, dtype=torch.float32, seed=0):
    """q, k, v in `dtype` (like a conv output), g and beta from random projections through
    `gdn_gating` (float32), random float32 initial states (one per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(seq_lens), len(seq_lens)
    q = torch.randn(T, Hk, dk, generator=gen).to(dtype)
    k = torch.randn(T, Hk, dk, generator=gen).to(dtype)
    v = torch.randn(T, Hv, dv, generator=gen).to(dtype)
    a = torch.randn(T, Hv, generator=gen)
    b = torch.randn(T, Hv, generator=gen)
    A_log = torch.empty(Hv).uniform_(0.0, 2.5, generator=gen)  # decays down to exp(-12 * dt)
    dt_bias = torch.randn(Hv, generator=gen) * 0.5
    g, beta = gdn_gating(a, b, A_log, dt_bias, 1.0)
    init = torch.randn(S, Hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, init


def chunk_end_positions(n: int, p0: int, chunk: int, num_chunks: int):
    """(chunk index, local index of its last token) for each chunk that ends inside the sequence."""
    for c in range(num_chunks):
        j = p0 - p0 % chunk + (c + 1) * chunk - p0 - 1
        if 0 <= j < n:
            yield c, j


# seq_lens, start_pos, chunk, (Hk, Hv, dk, dv): sequences shorter than a chunk, resumed at odd
# positions, chunk sizes 1 / odd / 64, k heads repeated to more v heads, odd head dims.
CASES = [
    ([1], [0], 4, (2, 4, 8, 6)),
    ([9, 3, 17], [0, 5, 2], 4, (2, 4, 8, 6)),
    ([7, 2], [3, 0], 1, (1, 3, 5, 7)),
    ([28, 1, 40], [100, 3, 64], 16, (2, 2, 16, 8)),
    ([13, 6, 11], [2, 9, 0], 5, (3, 6, 7, 9)),
    ([70, 100], [100, 0], 64, (2, 4, 16, 16)),
]


@pytest.mark.parametrize("seq_lens,start_pos,chunk,dims", CASES)
def test_chunked_rule_matches_token_recurrence_and_chunk_end_states(
    seq_lens, start_pos, chunk, dims
):
    Hk, Hv, dk, dv = dims
    q, k, v, g, beta, init = gdn_inputs(seq_lens, Hk, Hv, dk, dv)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    out = chunk_gated_delta_rule_torch(q, k, v, g, beta, init, layout)
    o_ref, final_ref, per_token = gated_delta_oracle(q, k, v, g, beta, init, seq_lens)
    torch.testing.assert_close(out.o.double(), o_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.final_states.double(), final_ref, atol=1e-5, rtol=1e-4)
    assert out.chunk_states.shape == (len(seq_lens), layout.num_chunks, Hv, dk, dv)
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        ends = list(chunk_end_positions(n, p0, chunk, layout.num_chunks))
        for c, j in ends:
            torch.testing.assert_close(
                out.chunk_states[s, c].double(), per_token[s][j], atol=1e-5, rtol=1e-4
            )
        # Chunks past the sequence's last hold its final state.
        last = -(-(p0 % chunk + n) // chunk)
        for c in range(last, layout.num_chunks):
            assert torch.equal(out.chunk_states[s, c], out.final_states[s])


def test_chunked_rule_in_half_precision_matches_the_oracle_on_the_same_inputs():
    seq_lens, start_pos = [19, 5], [7, 0]
    q, k, v, g, beta, init = gdn_inputs(seq_lens, dtype=torch.float16, seed=3)
    layout = build_chunk_layout(seq_lens, start_pos, 8, "cpu")
    out = chunk_gated_delta_rule_torch(q, k, v, g, beta, init, layout)
    o_ref, final_ref, _ = gated_delta_oracle(q, k, v, g, beta, init, seq_lens)
    assert out.o.dtype == torch.float16 and out.final_states.dtype == torch.float32
    torch.testing.assert_close(out.o.double(), o_ref, atol=2e-3, rtol=2e-3)  # fp16 output rounding
    torch.testing.assert_close(out.final_states.double(), final_ref, atol=1e-5, rtol=1e-4)


def test_padding_slots_are_exact_no_ops():
    """A short sequence batched with a longer one gets whole chunks of padding after its end (and
    padding before its odd start in both runs): its outputs and final state stay those of the
    sequence alone."""
    q, k, v, g, beta, init = gdn_inputs([10, 30], seed=5)
    batched = chunk_gated_delta_rule_torch(
        q, k, v, g, beta, init, build_chunk_layout([10, 30], [13, 0], 8, "cpu")
    )
    alone = chunk_gated_delta_rule_torch(
        q[:10],
        k[:10],
        v[:10],
        g[:10],
        beta[:10],
        init[:1],
        build_chunk_layout([10], [13], 8, "cpu"),
    )
    torch.testing.assert_close(batched.o[:10], alone.o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(batched.final_states[:1], alone.final_states, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def hf_rules():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    return hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("dims", [(2, 4, 8, 6), (2, 2, 16, 16)])
def test_chunked_rule_matches_transformers_reference(hf_rules, dims):
    """transformers' functions take one sequence (batch 1) chunked from its own first token:
    each sequence here starts at position 0, so its grid is the same."""
    hf_chunk, hf_recurrent = hf_rules
    Hk, Hv, dk, dv = dims
    seq_lens = [37, 12]
    q, k, v, g, beta, init = gdn_inputs(seq_lens, Hk, Hv, dk, dv, seed=7)
    out = chunk_gated_delta_rule_torch(
        q, k, v, g, beta, init, build_chunk_layout(seq_lens, [0, 0], 16, "cpu")
    )
    start = 0
    for s, n in enumerate(seq_lens):
        sl = slice(start, start + n)
        args = (q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl])
        o_c, final_c = hf_chunk(
            *args, chunk_size=16, initial_state=init[s : s + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        o_r, final_r = hf_recurrent(
            *args, initial_state=init[s : s + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        for o_hf, final_hf in ((o_c, final_c), (o_r, final_r)):
            torch.testing.assert_close(out.o[sl], o_hf[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out.final_states[s], final_hf[0], atol=1e-5, rtol=1e-4)
        start += n


def test_decode_step_matches_transformers_recurrent_reference(hf_rules):
    _, hf_recurrent = hf_rules
    Hk, Hv, dk, dv, batch = 2, 6, 8, 5, 3
    q, k, v, g, beta, _ = gdn_inputs([batch], Hk, Hv, dk, dv, seed=9)
    pool = torch.randn(5, Hv, dk, dv, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([4, 1, 2])
    before = pool.clone()
    o = gated_delta_decode_torch(q, k, v, g, beta, pool, slots)
    # transformers' batch axis is the requests; its sequence axis holds the one new token.
    o_hf, final_hf = hf_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=before[slots],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(o, o_hf[:, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pool[slots], final_hf, atol=1e-5, rtol=1e-4)
    for untouched in (0, 3):
        assert torch.equal(pool[untouched], before[untouched])


def test_decode_padding_rows_write_nothing_and_output_zero():
    Hk, Hv, dk, dv = 1, 2, 4, 3
    q, k, v, g, beta, _ = gdn_inputs([3], Hk, Hv, dk, dv, seed=11)
    pool = torch.randn(4, Hv, dk, dv)
    before = pool.clone()
    slots = torch.tensor([0, 2, 0])  # rows 0 and 2 pad the batch
    o = gated_delta_decode_torch(q, k, v, g, beta, pool, slots)
    o_ref, final_ref, _ = gated_delta_oracle(
        q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], before[2:3], [1]
    )
    torch.testing.assert_close(o[1].double(), o_ref[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pool[2].double(), final_ref[0], atol=1e-6, rtol=1e-5)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[2], torch.zeros_like(o[2]))
    for untouched in (0, 1, 3):
        assert torch.equal(pool[untouched], before[untouched])


def test_gating_matches_the_model_expressions_and_scales_beta():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(5, 3, generator=gen).bfloat16(), torch.randn(5, 3, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    g, beta = gdn_gating(a, b, A_log, dt_bias, 1.0)
    _, beta2 = gdn_gating(a, b, A_log, dt_bias, 2.0)
    expected_g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, expected_g)
    assert torch.equal(beta, b.sigmoid().float())  # rounded to bf16 first, as the model does
    assert torch.equal(beta2, (b.sigmoid() * 2.0).float())


def test_mismatched_shapes_and_slot_counts_are_named_errors():
    from baton.kernels.gated_delta import gated_delta_decode, gated_delta_prefill

    q, k, v, g, beta, init = gdn_inputs([4, 2])
    pool = torch.zeros(3, 4, 8, 6)
    layout = build_chunk_layout([4, 2], [0, 0], 4, "cpu")
    with pytest.raises(ValueError, match="num_v_heads 4 must be a multiple of num_k_heads 3"):
        chunk_gated_delta_rule_torch(q[:, :1].expand(-1, 3, -1), k[:, :1].expand(-1, 3, -1),
                                     v, g, beta, init, layout)  # fmt: skip
    with pytest.raises(ValueError, match=r"states must be .* \(\.\.\., 4, 8, 6\)"):
        gated_delta_prefill(q, k, v, g, beta, torch.zeros(3, 4, 6, 8), torch.tensor([1, 2]),
                            layout, False)  # fmt: skip
    with pytest.raises(ValueError, match=r"state_indices must hold one slot per row, \(2,\)"):
        gated_delta_prefill(q, k, v, g, beta, pool, torch.tensor([1]), layout, False)
    with pytest.raises(ValueError, match=r"g, beta \(6, 4\)"):
        gated_delta_decode(q, k, v, g[:, :2], beta, pool, torch.arange(6))
