"""The RG-LRU's torch path (kernels/rglru.py) against a float64 token-by-token oracle written from
Griffin's equations: the prefill scan over a batch of sequences resumed at unaligned positions
(one from position 0, where the state resets and the input is not normalised), its states at
every aligned chunk end and its final states in the pool; the decode step; the gates op for op
against transformers' RecurrentGemmaRglru; and the C prefill scan and fused C decode step
(kernels/cpu/rglru.c) against the oracle and the torch step."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.conv1d import causal_conv1d_update
from baton.kernels.cpu import rglru as cpu_rglru
from baton.kernels.rglru import (
    RGLRUWeights,
    rglru_inputs,
    rglru_scan_pool,
    rglru_update,
)
from baton.kernels.ssd import build_chunk_layout

HEADS, BW = 3, 4
WIDTH = HEADS * BW


@pytest.fixture(params=["torch", "c"])
def path(request, monkeypatch) -> str:
    """Which scan kernels/rglru.py's rglru_scan_pool runs on these CPU tensors."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_rglru, "scan_supported", lambda u, pool: False)
    elif cpu_rglru.library() is None:
        pytest.skip("the C kernels are not built")
    return request.param


def random_weights(gen: torch.Generator, heads: int = HEADS) -> RGLRUWeights:
    return RGLRUWeights(
        recurrent_param=torch.randn(heads * BW, generator=gen),
        input_gate_weight=torch.randn(heads, BW, BW, generator=gen) / 2,
        input_gate_bias=torch.randn(heads, BW, generator=gen) / 4,
        recurrent_gate_weight=torch.randn(heads, BW, BW, generator=gen) / 2,
        recurrent_gate_bias=torch.randn(heads, BW, generator=gen) / 4,
    )


def oracle(
    x: torch.Tensor, start: int, h0: torch.Tensor, w: RGLRUWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float64, one token at a time: (y (n, width), states after each token)."""
    w64 = [t.double() for t in w]
    h = h0.double().clone()
    ys, states = [], []
    for t, xt in enumerate(x.double()):
        blocks = xt.view(-1, BW)
        i = torch.sigmoid(torch.einsum("hb,hbc->hc", blocks, w64[1]) + w64[2]).flatten()
        r = torch.sigmoid(torch.einsum("hb,hbc->hc", blocks, w64[3]) + w64[4]).flatten()
        log_a = -8.0 * r * torch.nn.functional.softplus(w64[0])
        first = start + t == 0
        a = torch.zeros_like(log_a) if first else log_a.exp()
        scale = torch.ones_like(log_a) if first else (1 - (2 * log_a).exp()).sqrt()
        h = a * h + xt.double() * i * scale
        ys.append(h.clone())
        states.append(h.clone())
    return torch.stack(ys), torch.stack(states)


@pytest.mark.parametrize("heads", [HEADS, 24], ids=["narrow", "two-blocks"])
def test_prefill_scan_matches_the_float64_oracle_with_states_at_chunk_ends(path, heads):
    """24 heads of 4: a width of 96, one full and one partial block of the C scan's 64."""
    gen = torch.Generator().manual_seed(0)
    w = random_weights(gen, heads)
    chunk, width = 8, heads * BW
    lens, starts = [1, 19, 30, 5], [0, 3, 0, 16]  # resumed unaligned, from 0, aligned
    x = torch.randn(sum(lens), width, generator=gen)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    pool = torch.zeros(6, width)
    slots = torch.tensor([4, 1, 2, 5])
    pool[slots] = torch.randn(len(lens), width, generator=gen)
    pool[2] = 0.0  # a fresh request (position 0): whatever a slot held must not matter
    h0 = pool[slots].clone()
    layout = build_chunk_layout(lens, starts, chunk, "cpu")
    a, u = rglru_inputs(x, positions, w)
    out = rglru_scan_pool(a, u, pool, slots, layout)
    offset = 0
    for s, (n, start) in enumerate(zip(lens, starts)):
        want_y, states = oracle(x[offset : offset + n], start, h0[s], w)
        torch.testing.assert_close(
            out.y[offset : offset + n].double(), want_y, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(pool[slots[s]].double(), states[-1], rtol=1e-5, atol=1e-5)
        # the state after each aligned chunk end this sequence crosses (chunk index j holds
        # the state after absolute position (start // chunk + j + 1) * chunk - 1)
        # (past the sequence's end: its final state)
        for j in range(layout.num_chunks):
            end = (start // chunk + j + 1) * chunk  # positions before it are in the state
            after = end - start - 1 if end <= start + n else n - 1
            torch.testing.assert_close(
                out.chunk_states[s, j].double(), states[after], rtol=1e-5, atol=1e-5
            )
        offset += n


def test_decode_steps_continue_the_prefill_state():
    gen = torch.Generator().manual_seed(1)
    w = random_weights(gen)
    x = torch.randn(9, WIDTH, generator=gen)
    want, _ = oracle(x, 0, torch.zeros(WIDTH), w)
    pool, slot = torch.zeros(3, WIDTH), torch.tensor([2])
    layout = build_chunk_layout([6], [0], 4, "cpu")
    a, u = rglru_inputs(x[:6], torch.arange(6), w)
    got = [rglru_scan_pool(a, u, pool, slot, layout).y]
    for t in range(6, 9):
        a, u = rglru_inputs(x[t : t + 1], torch.tensor([t]), w)
        got.append(rglru_update(a, u, pool, slot))
    torch.testing.assert_close(torch.cat(got).double(), want, rtol=1e-5, atol=1e-5)
    assert pool[0].abs().sum() == 0 and pool[1].abs().sum() == 0  # other slots untouched


def test_inputs_are_transformers_gates_op_for_op():
    """Same gates, decay and normalised input as RecurrentGemmaRglru, the reset at position 0
    included: its outputs to float32 rounding (the scan sums in another order)."""
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    gen = torch.Generator().manual_seed(2)
    w = random_weights(gen)
    lru = RecurrentGemmaRglru(
        RecurrentGemmaConfig(hidden_size=WIDTH, lru_width=WIDTH, num_attention_heads=HEADS)
    )
    with torch.no_grad():
        for name, value in w._asdict().items():
            getattr(lru, name).copy_(value)
    x = torch.randn(1, 7, WIDTH, generator=gen)
    with torch.no_grad():
        want = lru(x, torch.arange(7)[None])[0]
    a, u = rglru_inputs(x[0], torch.arange(7), w)
    pool = torch.zeros(2, WIDTH)
    got = rglru_scan_pool(a, u, pool, torch.tensor([1]), build_chunk_layout([7], [0], 8, "cpu"))
    torch.testing.assert_close(got.y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(cpu_rglru.library() is None, reason="the C++ extension is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_c_decode_step_matches_the_torch_step(dtype):
    """kernels/cpu/rglru.c's conv + RG-LRU step = causal_conv1d_update + rglru_inputs +
    rglru_update on the same pools (float32 to rounding; bf16 to a bf16 ulp or two), the conv
    window shifted alike, other slots untouched, a slot outside the pool refused by name."""
    gen = torch.Generator().manual_seed(4)
    w, K, batch = random_weights(gen), 4, 3
    conv_w, conv_b = torch.randn(WIDTH, K, generator=gen) / 2, torch.randn(WIDTH, generator=gen)
    w = RGLRUWeights(*(t.to(dtype) for t in w))
    conv_w, conv_b = conv_w.to(dtype), conv_b.to(dtype)
    x = torch.randn(batch, WIDTH, generator=gen).to(dtype)
    slots = torch.tensor([3, 1, 4])
    conv_pools = [torch.randn(5, WIDTH, K - 1, generator=gen).to(dtype)]
    lru_pools = [torch.randn(5, WIDTH, generator=gen)]
    conv_pools.append(conv_pools[0].clone())
    lru_pools.append(lru_pools[0].clone())
    conv = causal_conv1d_update(x, conv_w, conv_b, conv_pools[0], slots, activation="none")
    a, u = rglru_inputs(conv, torch.full((batch,), 7), w)
    want = rglru_update(a, u, lru_pools[0], slots)
    params = cpu_rglru.RGLRUDecodeParams.of(conv_w, conv_b, w)
    got = cpu_rglru.rglru_decode_cpu(x, conv_pools[1], lru_pools[1], slots, params)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(lru_pools[1], lru_pools[0], **tol)
    torch.testing.assert_close(conv_pools[1], conv_pools[0], rtol=0, atol=0)
    with pytest.raises(IndexError, match="slot index 9 of row 1"):
        cpu_rglru.rglru_decode_cpu(x, conv_pools[1], lru_pools[1], torch.tensor([1, 9, 2]), params)
