"""Lightning attention's torch path (kernels/lightning.py) and its C scan (kernels/cpu/lightning.c)
against a float64 token-by-token oracle of S_t = g S_{t-1} + k_t^T v_t, o_t = q_t S_t: the
prefill over a batch of sequences resumed at unaligned positions (and one shorter than its
chunk), its states after every chunk end a sequence crosses (and the final state in the chunks
past its end) and its final states in the pool; decode steps after a prefill; the C scan against
the torch path at a width of a full and a partial column block; and the decay rates against
transformers' MiniMaxLightningAttention.get_slope_rate."""

from __future__ import annotations

import pytest
import torch

from baton.engine.layers.lightning_attention import decay_rates
from baton.kernels.cpu import lightning as cpu_lightning
from baton.kernels.lightning import lightning_decode, lightning_prefill_pool
from baton.kernels.ssd import build_chunk_layout

H, D = 3, 4
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["torch", "c"])
def path(request, monkeypatch) -> str:
    """Which implementation kernels/lightning.py runs on these CPU tensors."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_lightning, "supported", lambda v, pool: False)
    elif cpu_lightning.library() is None:
        pytest.skip("the C kernels are not built")
    return request.param


def oracle(q, k, v, decay, h0):
    """One sequence, float64: (outputs (n, H, D), states after each token (n, H, D, D))."""
    g = torch.exp(-decay.double())[:, None, None]
    state = h0.double().clone()
    outs, states = [], []
    for qt, kt, vt in zip(q.double(), k.double(), v.double()):
        state = g * state + kt[:, :, None] * vt[:, None, :]
        outs.append(torch.einsum("hd,hde->he", qt, state))
        states.append(state.clone())
    return torch.stack(outs), torch.stack(states)


def test_prefill_matches_the_float64_oracle_with_states_at_chunk_ends(path):
    gen = torch.Generator().manual_seed(0)
    decay = torch.rand(H, generator=gen) * 0.5
    chunk = 8
    lens, starts = [1, 19, 30, 5], [0, 3, 0, 16]
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    pool = torch.zeros(6, H, D, D)
    slots = torch.tensor([4, 1, 2, 5])
    pool[slots] = torch.randn(len(lens), H, D, D, generator=gen)
    h0 = pool[slots].clone()
    layout = build_chunk_layout(lens, starts, chunk, "cpu")
    scan = lightning_prefill_pool(q, k, v, decay, pool, slots, layout)
    offset = 0
    for s, (n, start) in enumerate(zip(lens, starts)):
        rows = slice(offset, offset + n)
        want, states = oracle(q[rows], k[rows], v[rows], decay, h0[s])
        torch.testing.assert_close(scan.out[rows].double(), want, **TOL)
        torch.testing.assert_close(pool[slots[s]].double(), states[-1], **TOL)
        for j in range(layout.num_chunks):
            end = (start // chunk + j + 1) * chunk
            after = end - start - 1 if end <= start + n else n - 1  # past the end: final
            torch.testing.assert_close(scan.chunk_states[s, j].double(), states[after], **TOL)
        offset += n


def test_decode_steps_continue_the_prefill_state(path):
    gen = torch.Generator().manual_seed(1)
    decay = torch.rand(H, generator=gen)
    q, k, v = (torch.randn(9, H, D, generator=gen) for _ in range(3))
    want, _ = oracle(q, k, v, decay, torch.zeros(H, D, D))
    pool, slot = torch.zeros(3, H, D, D), torch.tensor([2])
    layout = build_chunk_layout([6], [0], 4, "cpu")
    got = [lightning_prefill_pool(q[:6], k[:6], v[:6], decay, pool, slot, layout).out]
    for t in range(6, 9):
        got.append(lightning_decode(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay, pool, slot))
    torch.testing.assert_close(torch.cat(got).double(), want, **TOL)
    assert pool[0].abs().sum() == 0 and pool[1].abs().sum() == 0


def test_decay_rates_are_transformers_slope_rates():
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = MiniMaxConfig(hidden_size=48, num_attention_heads=6, num_hidden_layers=5)
    for layer in (0, 3, 4):
        want = MiniMaxLightningAttention(config, layer).slope_rate.view(-1)
        torch.testing.assert_close(decay_rates(6, layer, 5), want, rtol=0, atol=0)


@pytest.mark.skipif(cpu_lightning.library() is None, reason="the C kernels are not built")
def test_c_scan_matches_torch_over_a_full_and_a_partial_column_block(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    heads, d, chunk, lens, starts = 2, 40, 8, [13, 21], [5, 0]
    decay = torch.rand(heads, generator=gen)
    q, k, v = (torch.randn(sum(lens), heads, d, generator=gen) * 0.5 for _ in range(3))
    layout = build_chunk_layout(lens, starts, chunk, "cpu")
    pool = torch.randn(4, heads, d, d, generator=gen)
    slots, rows = torch.tensor([3, 1]), torch.tensor([1, 0, 3])  # row 1: padding
    runs = {}
    for name in ("c", "torch"):
        if name == "torch":
            monkeypatch.setattr(cpu_lightning, "supported", lambda v, pool: False)
        p = pool.clone()
        scan = lightning_prefill_pool(q, k, v, decay, p, slots, layout)
        step = lightning_decode(q[:3], k[:3], v[:3], decay, p, rows)
        runs[name] = scan, step, p
    (c_scan, c_step, c_pool), (t_scan, t_step, t_pool) = runs["c"], runs["torch"]
    torch.testing.assert_close(c_scan.out, t_scan.out, **TOL)
    torch.testing.assert_close(c_scan.chunk_states, t_scan.chunk_states, **TOL)
    torch.testing.assert_close(c_step[[0, 2]], t_step[[0, 2]], **TOL)
    assert (c_step[1] == 0).all()  # a padding row reads and writes nothing
    torch.testing.assert_close(c_pool[1:], t_pool[1:], **TOL)
    torch.testing.assert_close(c_pool[0], pool[0])


@pytest.mark.skipif(cpu_lightning.library() is None, reason="the C kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_decode_step_matches_the_layer_parts(dtype):
    """baton_lightning_decode (SiLU, the step, the output norm over every head, the gate) against
    the layer's unfused path: the SiLU'd projections, the torch step, MiniMax's RMS norm and the
    sigmoid gate, rounded to the model dtype where they are (two heads of 40: a full and a
    partial column block). A padding row (slot 0) writes nothing and gives 0."""
    gen = torch.Generator().manual_seed(5)
    heads, d, eps = 2, 40, 1e-6
    width = heads * d
    qkv = (torch.randn(3, 3 * width, generator=gen) * 0.7).to(dtype)
    gate = torch.randn(3, width, generator=gen).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)
    decay = torch.rand(heads, generator=gen)
    pool = torch.randn(4, heads, d, d, generator=gen) * 0.3
    slots = torch.tensor([2, 0, 3])  # row 1: padding
    fused_pool = pool.clone()
    fused = cpu_lightning.lightning_layer_decode_cpu(
        qkv, gate, norm_weight, decay, fused_pool, slots, eps
    )
    parts_pool = pool.clone()
    q, k, v = torch.nn.functional.silu(qkv).view(3, heads, 3 * d).split(d, dim=-1)
    ratio = torch.exp(-decay).view(1, -1, 1, 1)
    state = ratio * parts_pool[slots] + k.float()[..., :, None] * v.float()[..., None, :]
    parts_pool[slots[[0, 2]]] = state[[0, 2]]
    o = (q.float()[..., None, :] @ state).squeeze(-2).to(dtype).reshape(3, width).float()
    normed = (o * torch.rsqrt(o.pow(2).sum(-1, keepdim=True) / width + eps)).to(dtype)
    parts = torch.sigmoid(gate) * (norm_weight * normed)
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused[[0, 2]].float(), parts[[0, 2]].float(), **tol)
    assert (fused[1] == 0).all()
    torch.testing.assert_close(fused_pool, parts_pool, **TOL)  # slot 0 untouched in both


@pytest.mark.skipif(cpu_lightning.library() is None, reason="the C kernels are not built")
def test_fused_layer_decode_refuses_a_slot_outside_the_pool():
    qkv, gate, weight = torch.zeros(1, 3 * 8), torch.zeros(1, 8), torch.ones(8)
    pool = torch.zeros(2, 2, 4, 4)
    with pytest.raises(IndexError, match="slot index 5 of row 0"):
        cpu_lightning.lightning_layer_decode_cpu(
            qkv, gate, weight, torch.ones(2), pool, torch.tensor([5]), 1e-6
        )
