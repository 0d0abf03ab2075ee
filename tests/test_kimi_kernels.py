"""Kimi Linear's kernels against naive oracles: KDA's chunked prefill and decode step
(kernels/kda.py's torch path and kernels/cpu/kda.c's scan and fused decode step) against a float64
token-by-token recurrence and against transformers 5.25's own reference functions; MLA's absorbed attention over the latent pages (kernels/mla.py) against the
expanded per-head K/V attention transformers computes."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.attention import build_attention_layout
from baton.kernels.conv1d import build_window_layout
from baton.kernels.cpu import kda as cpu_kda
from baton.kernels.kda import chunk_kda_torch, kda_decode, kda_decode_torch, kda_gate, kda_prefill
from baton.kernels.kda_mixer import (
    KDAMixerDims,
    KDAMixerWeights,
    kda_mixer_decode,
    kda_mixer_prefill,
)
from baton.kernels.mla import mla_attention
from baton.kernels.ssd import build_chunk_layout

needs_c = pytest.mark.skipif(cpu_kda.library() is None, reason="the C kernels are not built")


def kda_oracle(q, k, v, g, beta, init):
    """One sequence, float64, token by token: q, k (n, H, dk), v (n, H, dv), g (n, H, dk),
    beta (n, H), init (H, dk, dv). Returns (o (n, H, dv), states after each token (n, H, dk,
    dv))."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state, outs, states = init.double().clone(), [], []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        kv = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t][..., None] * ((v[t] - kv) * beta[t][:, None])[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
        states.append(state.clone())
    return torch.stack(outs), torch.stack(states)


def kda_inputs(seq_lens, H=3, dk=8, dv=6, seed=0, strong_decay=False):
    """Inputs as the layer makes them: g through `kda_gate` from random projections (A_log as
    transformers initialises it, log(1..16); strong_decay: large f, log decays of tens per token,
    where a factored exp(-cum) would overflow), beta a sigmoid."""
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(seq_lens), len(seq_lens)
    q, k = (torch.randn(T, H, dk, generator=gen) for _ in range(2))
    v = torch.randn(T, H, dv, generator=gen)
    f = torch.randn(T, H * dk, generator=gen) * (8.0 if strong_decay else 1.0)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    dt_bias = torch.randn(H * dk, generator=gen) * 0.5
    g = kda_gate(f, A_log, dt_bias, dk)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    init = torch.randn(S, H, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, init


# seq_lens, start_pos, chunk: shorter than a chunk, resumed mid-chunk, chunk 1, odd, 64.
CASES = [
    ([1], [0], 4),
    ([9, 3, 17], [0, 5, 2], 4),
    ([7, 2], [3, 0], 1),
    ([13, 6, 11], [2, 9, 0], 5),
    ([70, 30], [100, 0], 64),
]


@pytest.mark.parametrize("seq_lens,start_pos,chunk", CASES)
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_kda_matches_token_recurrence_with_true_chunk_end_states(
    seq_lens, start_pos, chunk, strong_decay
):
    q, k, v, g, beta, init = kda_inputs(seq_lens, strong_decay=strong_decay)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    out = chunk_kda_torch(q, k, v, g, beta, init, layout)
    assert torch.isfinite(out.o).all()
    offset = 0
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        rows = slice(offset, offset + n)
        o_ref, states = kda_oracle(q[rows], k[rows], v[rows], g[rows], beta[rows], init[s])
        torch.testing.assert_close(out.o[rows].double(), o_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out.final_states[s].double(), states[-1], atol=1e-5, rtol=1e-4)
        for c in range(layout.num_chunks):  # a chunk ending inside the sequence: its true state
            j = p0 - p0 % chunk + (c + 1) * chunk - p0 - 1
            if 0 <= j < n:
                torch.testing.assert_close(
                    out.chunk_states[s, c].double(), states[j], atol=1e-5, rtol=1e-4
                )
        offset += n


@needs_c
@pytest.mark.parametrize("seq_lens,start_pos,chunk", CASES[1:])
def test_c_scan_matches_token_recurrence_with_true_chunk_end_states(seq_lens, start_pos, chunk):
    """The C prefill on pool slots (dv 40: a full and a partial column block)."""
    q, k, v, g, beta, init = kda_inputs(seq_lens, H=2, dk=8, dv=40, seed=1)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    pool = torch.zeros(len(seq_lens) + 2, 2, 8, 40)
    slots = torch.arange(len(seq_lens)) + 2
    pool[slots] = init
    assert cpu_kda.supported(v, pool)
    o, chunk_states = kda_prefill(q, k, v, g, beta, pool, slots, layout)
    offset = 0
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        rows = slice(offset, offset + n)
        o_ref, states = kda_oracle(q[rows], k[rows], v[rows], g[rows], beta[rows], init[s])
        torch.testing.assert_close(o[rows].double(), o_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(pool[slots[s]].double(), states[-1], atol=1e-5, rtol=1e-4)
        ends = [c for c in range(layout.num_chunks)
                if 0 <= p0 - p0 % chunk + (c + 1) * chunk - p0 - 1 < n]  # fmt: skip
        for c in range(layout.num_chunks):  # true chunk-end states, then the final one
            j = p0 - p0 % chunk + (c + 1) * chunk - p0 - 1 if c in ends else n - 1
            torch.testing.assert_close(chunk_states[s, c].double(), states[j], atol=1e-5, rtol=1e-4)
        offset += n


@pytest.mark.parametrize(
    "decode", [kda_decode_torch, pytest.param(kda_decode, marks=needs_c)], ids=["torch", "c"]
)
def test_decode_steps_match_token_recurrence_and_skip_padding_rows(decode):
    H, dk, dv, steps = 2, 8, 4, 5
    q, k, v, g, beta, _ = kda_inputs([steps * 2], H, dk, dv, seed=3)
    pool = torch.randn(4, H, dk, dv)
    start = pool.clone()
    slots = torch.tensor([2, 0])  # row 1 is padding on the dummy slot
    outs = []
    for t in range(steps):
        rows = slice(2 * t, 2 * t + 2)
        outs.append(decode(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, slots))
    live = slice(0, 2 * steps, 2)
    o_ref, states = kda_oracle(q[live], k[live], v[live], g[live], beta[live], start[2])
    torch.testing.assert_close(torch.stack([o[0] for o in outs]).double(), o_ref, atol=2e-5,
                               rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(pool[2].double(), states[-1], atol=1e-5, rtol=1e-4)
    assert all((o[1] == 0).all() for o in outs)
    torch.testing.assert_close(pool[0], start[0])  # the dummy slot is left as it was
    torch.testing.assert_close(pool[[1, 3]], start[[1, 3]])


def test_kda_matches_transformers_reference_functions():
    from transformers.models.kimi_linear import modeling_kimi_linear as ref

    q, k, v, g, beta, init = kda_inputs([37], H=2, dk=16, dv=16, seed=5)
    layout = build_chunk_layout([37], [0], 16, "cpu")
    ours = chunk_kda_torch(q, k, v, g, beta, init, layout)
    args = [t[None] for t in (q, k, v, g, beta)]
    o_chunk, s_chunk = ref.chunk_kimi_delta_attention(
        *args[:3], g=args[3], beta=args[4], chunk_size=16, initial_state=init,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(ours.o, o_chunk[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.final_states, s_chunk, atol=1e-5, rtol=1e-4)
    pool = init.clone().repeat(2, 1, 1, 1)  # slot 1 holds the initial state
    o_step = kda_decode_torch(q[:1], k[:1], v[:1], g[:1], beta[:1], pool, torch.tensor([1]))
    o_rec, s_rec = ref.recurrent_kimi_delta_attention(
        *[t[:, :1] for t in args[:3]], g=args[3][:, :1], beta=args[4][:, :1],
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(o_step, o_rec[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pool[1:], s_rec, atol=1e-6, rtol=1e-5)


def mixer_case(dtype: torch.dtype, H=2, d=8, K=4, batch=3, seed=2, lower_bound=None):
    """Random projections and weights of one KDA mixer, pools with state in slots 1..batch."""
    gen = torch.Generator().manual_seed(seed)
    W = H * d
    weights = KDAMixerWeights(
        conv_weight=(torch.randn(3 * W, K, generator=gen) * 0.5).to(dtype),
        A_log=torch.empty(H).uniform_(1.0, 16.0, generator=gen).log(),
        dt_bias=torch.randn(W, generator=gen) * 0.5,
        norm_weight=(1 + 0.1 * torch.randn(d, generator=gen)).to(dtype),
    )
    rows = [torch.randn(batch, n, generator=gen).to(dtype) for n in (3 * W, W, H, W)]
    conv = torch.randn(batch + 1, 3 * W, K - 1, generator=gen).to(dtype)
    state = torch.randn(batch + 1, H, d, d, generator=gen) * 0.3
    dims = KDAMixerDims(num_heads=H, head_dim=d, norm_eps=1e-5, gate_lower_bound=lower_bound)
    return weights, dims, rows, conv, state


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_fused_c_decode_step_matches_the_composite_mixer(dtype, lower_bound):
    """Conv, decay (Kimi's softplus or Bailing's bounded gate), beta, the rule and the gated norm
    in one C call = the composite path (torch ops and the plain rule), padding rows (slot 0)
    untouched with zero output."""
    weights, dims, rows, conv, state = mixer_case(dtype, lower_bound=lower_bound)
    slots = torch.tensor([3, 0, 1])
    fused_conv, fused_state = conv.clone(), state.clone()
    fused = kda_mixer_decode(*rows, fused_conv, fused_state, slots, weights, dims,
                             weights.decode_params())  # fmt: skip
    plain = kda_mixer_decode(*rows, conv, state, slots, weights, dims, None)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused.float(), plain.float(), **tol)
    assert (fused[1] == 0).all()
    # live slots alike (the composite conv shifts the dummy slot's window; the fused step skips it)
    torch.testing.assert_close(fused_conv[1:], conv[1:])
    torch.testing.assert_close(fused_state[1:], state[1:], **tol)


def test_mixer_prefill_then_decode_matches_one_longer_prefill():
    """The conv window and the state a prefill leaves are what the next decode step continues
    from: prefill of n tokens + one decode step = prefill of n + 1 tokens (last row)."""
    weights, dims, _, _, _ = mixer_case(torch.float32, batch=1)
    gen = torch.Generator().manual_seed(4)
    n, W, H = 9, dims.width, dims.num_heads
    rows = [torch.randn(n + 1, m, generator=gen) for m in (3 * W, W, H, W)]

    def prefill(count):
        conv, state = torch.zeros(2, 3 * W, 3), torch.zeros(2, H, 8, 8)
        out = kda_mixer_prefill(
            *[r[:count] for r in rows], conv, state, torch.tensor([1]),
            build_window_layout([count], 4, "cpu"), build_chunk_layout([count], [0], 4, "cpu"),
            weights, dims, window_tokens=None,
        )  # fmt: skip
        return out.out, conv, state

    _, conv, state = prefill(n)
    step = kda_mixer_decode(*[r[n:] for r in rows], conv, state, torch.tensor([1]), weights, dims,
                            None)  # fmt: skip
    whole, _, _ = prefill(n + 1)
    torch.testing.assert_close(step[0], whole[n], atol=1e-5, rtol=1e-4)


def expanded_mla(q, latent, w_kv_b, nope, vdim, scale, causal_from):
    """transformers' form for one sequence: per-head K = [W_UK c | k_rope], V = W_UV c.
    q: (n, H, nope + rope); latent: (m, L + rope) (the sequence's cache, the queries last);
    w_kv_b: (H * (nope + vdim), L). Returns (n, H, vdim), float64."""
    q, latent, w = q.double(), latent.double(), w_kv_b.double()
    H, L = q.shape[1], w.shape[1]
    kv = (latent[:, :L] @ w.T).view(-1, H, nope + vdim)
    keys = torch.cat([kv[..., :nope], latent[:, None, L:].expand(-1, H, -1)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    n, m = q.shape[0], latent.shape[0]
    visible = torch.arange(m)[None, :] <= causal_from + torch.arange(n)[:, None]
    probs = scores.masked_fill(~visible, -torch.inf).softmax(-1)
    return torch.einsum("hqk,khv->qhv", probs, kv[..., nope:])


def test_absorbed_latent_attention_matches_expanded_heads():
    """Two sequences over paged latents (a decode-like one query after 6 cached tokens and a
    3-token extend after 2), pages of 4 in scattered order."""
    gen = torch.Generator().manual_seed(9)
    H, nope, rope, vdim, L, page = 3, 8, 4, 6, 10, 4
    scale = (nope + rope) ** -0.5
    w_kv_b = torch.randn(H * (nope + vdim), L, generator=gen) * 0.3
    cache = torch.zeros(8 * page, L + rope)
    q_lens, kv_lens = [1, 3], [7, 5]
    pages = [[5, 2], [3, 6]]
    kv_indices = torch.tensor([[p * page + i for p in ps for i in range(page)] for ps in pages])
    latents = [torch.randn(n, L + rope, generator=gen) for n in kv_lens]
    for s, lat in enumerate(latents):
        cache[kv_indices[s, : kv_lens[s]]] = lat
    q = torch.randn(sum(q_lens), H, nope + rope, generator=gen)
    layout = build_attention_layout(q_lens, kv_lens, kv_indices, "cpu")
    out = mla_attention(q, cache, w_kv_b, layout, nope=nope, v_head_dim=vdim, scale=scale)
    offset = 0
    for s, (n, m) in enumerate(zip(q_lens, kv_lens)):
        ref = expanded_mla(q[offset : offset + n], latents[s], w_kv_b, nope, vdim, scale, m - n)
        torch.testing.assert_close(out[offset : offset + n].double(), ref, atol=1e-5, rtol=1e-5)
        offset += n
