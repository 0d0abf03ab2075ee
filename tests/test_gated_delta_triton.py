"""The gated delta rule's Triton kernels, run by the interpreter (TRITON_INTERPRET=1, set in
conftest) on CPU tensors through the public functions with BATON_KERNELS=triton, against the
torch path and the float64 oracle, in float32 and float16."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_torch,
    gated_delta_decode,
    gated_delta_decode_torch,
    gated_delta_prefill,
)
from baton.kernels.ssd import build_chunk_layout
from baton.kernels.triton import gated_delta as triton_gated_delta
from tests.oracles import gated_delta_oracle
from tests.test_gated_delta import chunk_end_positions, gdn_inputs

DTYPES = [torch.float32, torch.float16]


@pytest.fixture
def triton_calls(monkeypatch) -> list[str]:
    """Force the Triton backend and record the launchers the public functions reach."""
    monkeypatch.setenv("BATON_KERNELS", "triton")
    calls: list[str] = []
    for name in ("chunk_gated_delta_rule_triton", "gated_delta_decode_triton"):
        real = getattr(triton_gated_delta, name)
        monkeypatch.setattr(
            triton_gated_delta,
            name,
            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a),
        )
    return calls


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)


# seq_lens, start_pos, chunk, (Hk, Hv, dk, dv): sequences shorter than a chunk, resumed mid-chunk,
# chunk sizes below the 16-slot tile (odd, and 1), k heads repeated, head dims not powers of two.
TRITON_CASES = [
    ([9, 3, 17], [0, 5, 2], 8, (2, 4, 8, 6)),
    ([20, 1], [37, 4], 16, (1, 2, 16, 24)),
    ([6, 4], [3, 0], 5, (2, 2, 5, 7)),
    ([3, 2], [1, 0], 1, (1, 1, 4, 4)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,start_pos,chunk,dims", TRITON_CASES)
def test_chunked_rule_matches_torch_path_oracle_and_chunk_end_states(
    triton_calls, seq_lens, start_pos, chunk, dims, dtype
):
    Hk, Hv, dk, dv = dims
    q, k, v, g, beta, init = gdn_inputs(seq_lens, Hk, Hv, dk, dv, dtype=dtype, seed=1)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    out = chunk_gated_delta_rule(q, k, v, g, beta, init, layout)
    assert triton_calls == ["chunk_gated_delta_rule_triton"]
    ref = chunk_gated_delta_rule_torch(q, k, v, g, beta, init, layout)
    o_oracle, _, per_token = gated_delta_oracle(q, k, v, g, beta, init, seq_lens)
    assert out.o.dtype == dtype
    torch.testing.assert_close(out.o.double(), ref.o.double(), **tol(dtype))
    torch.testing.assert_close(out.o.double(), o_oracle, **tol(dtype))
    # States are float32 whatever the activations: the float32 tolerance holds for both.
    torch.testing.assert_close(out.final_states, ref.final_states, **tol(torch.float32))
    torch.testing.assert_close(out.chunk_states, ref.chunk_states, **tol(torch.float32))
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        for c, j in chunk_end_positions(n, p0, chunk, layout.num_chunks):
            torch.testing.assert_close(
                out.chunk_states[s, c].double(), per_token[s][j], **tol(torch.float32)
            )


def test_prefill_on_pool_slots_goes_through_triton_and_writes_only_its_slots(triton_calls):
    seq_lens = [7, 12]
    q, k, v, g, beta, init = gdn_inputs(seq_lens, seed=2)
    pool = torch.randn(5, *init.shape[1:])
    pool[[3, 1]] = init
    before = pool.clone()
    layout = build_chunk_layout(seq_lens, [2, 0], 8, "cpu")
    o, chunk_states = gated_delta_prefill(
        q, k, v, g, beta, pool, torch.tensor([3, 1]), layout, True
    )
    ref = chunk_gated_delta_rule_torch(q, k, v, g, beta, init, layout)
    torch.testing.assert_close(o, ref.o, **tol(torch.float32))
    torch.testing.assert_close(chunk_states, ref.chunk_states, **tol(torch.float32))
    torch.testing.assert_close(pool[[3, 1]], ref.final_states, **tol(torch.float32))
    for untouched in (0, 2, 4):
        assert torch.equal(pool[untouched], before[untouched])
    pool[[3, 1]] = init
    o_again, none = gated_delta_prefill(q, k, v, g, beta, pool, torch.tensor([3, 1]), layout, False)
    assert none is None and torch.equal(o_again, o)
    assert triton_calls == ["chunk_gated_delta_rule_triton"] * 2
    torch.testing.assert_close(pool[[3, 1]], ref.final_states, **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(2, 4, 8, 6), (1, 3, 16, 40)])
def test_decode_matches_torch_path_and_skips_padding(triton_calls, dims, dtype):
    Hk, Hv, dk, dv = dims
    q, k, v, g, beta, _ = gdn_inputs([4], Hk, Hv, dk, dv, dtype=dtype, seed=3)
    pool = torch.randn(6, Hv, dk, dv, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([5, 0, 2, 3])
    t_pool, ref_pool = pool.clone(), pool.clone()
    o = gated_delta_decode(q, k, v, g, beta, t_pool, slots)
    o_ref = gated_delta_decode_torch(q, k, v, g, beta, ref_pool, slots)
    assert triton_calls == ["gated_delta_decode_triton"] and o.dtype == dtype
    torch.testing.assert_close(o.double(), o_ref.double(), **tol(dtype))
    torch.testing.assert_close(t_pool, ref_pool, **tol(torch.float32))
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    for untouched in (0, 1, 4):
        assert torch.equal(t_pool[untouched], pool[untouched])
