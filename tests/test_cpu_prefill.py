"""The fused C prefill scan (kernels/cpu/prefill.c) against the naive token recurrence and the
torch SSD path: varlen, lengths not multiples of the chunk, resumed sequences (initial states,
chunks aligned to absolute positions), the chunk states checkpoints read, dt limits, fp16/bf16
inputs, and bad slots."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.conv1d import build_window_layout, causal_conv1d_varlen_torch
from baton.kernels.cpu import prefill as cpu_prefill
from baton.kernels.cpu.extension import PORTABLE_FLAGS
from baton.kernels.norm import gated_rms_norm_torch
from baton.kernels.ssd import build_chunk_layout, discretize_dt, ssd_scan_pool, ssd_scan_torch
from tests.oracles import conv_oracle, ssd_oracle
from tests.test_kernels_torch import ssd_inputs

pytestmark = pytest.mark.skipif(
    cpu_prefill.library() is None, reason="no C compiler: the fused prefill scan is not built"
)


def run_c(seq_lens, start_pos, chunk, inputs, dt_limit=(0.0, float("inf")), slots=None):
    x, dt, A, B, C, D, dt_bias, init = inputs
    S = len(seq_lens)
    # a pool with more slots than sequences, the sequences in scattered slots
    pool = torch.randn(S + 3, *init.shape[1:])
    slots = torch.arange(S + 2, 2, -1)[:S] if slots is None else slots
    pool[slots] = init
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    y, chunk_states = cpu_prefill.ssd_prefill_cpu(
        x,
        discretize_dt(dt, dt_bias, dt_limit),
        A,
        B,
        C,
        D,
        pool,
        slots,
        layout.cu_seqlens,
        layout.start_pos,
        chunk,
        layout.num_chunks,
    )
    return y, pool[slots], chunk_states, layout


CASES = [
    ([1], [0], 4),
    ([7], [0], 4),
    ([8], [0], 4),
    ([9, 3, 17], [0, 5, 2], 4),
    ([28, 1, 40], [100, 3, 64], 16),
    ([5, 12], [13, 0], 8),
    ([130, 7, 64], [0, 200, 64], 64),
]


@pytest.mark.parametrize("seq_lens,start_pos,chunk", CASES)
def test_c_scan_matches_token_recurrence(seq_lens, start_pos, chunk):
    inputs = ssd_inputs(seq_lens, H=6, P=8, G=3, N=10, seed=1)
    y, final, chunk_states, layout = run_c(seq_lens, start_pos, chunk, inputs)
    y_ref, final_ref, per_token = ssd_oracle(*inputs, seq_lens)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double(), final_ref, atol=1e-4, rtol=1e-4)
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        first_chunk_start = p0 - p0 % chunk
        for c in range(layout.num_chunks):
            j = first_chunk_start + (c + 1) * chunk - p0 - 1  # last token inside chunk c
            expected = per_token[s][min(j, n - 1)]  # past the end: the final state
            torch.testing.assert_close(chunk_states[s, c].double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seq_lens,start_pos,chunk", CASES)
def test_c_scan_matches_torch_path(seq_lens, start_pos, chunk):
    inputs = ssd_inputs(seq_lens, H=4, P=16, G=2, N=12, seed=2)
    y, final, chunk_states, layout = run_c(seq_lens, start_pos, chunk, inputs)
    ref = ssd_scan_torch(*inputs, layout)
    torch.testing.assert_close(y, ref.y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref.final_states, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunk_states, ref.chunk_states, atol=1e-4, rtol=1e-4)


def test_c_scan_applies_dt_limit():
    seq_lens, start_pos = [9, 20], [0, 3]
    inputs = ssd_inputs(seq_lens, seed=3)
    limited, _, _, _ = run_c(seq_lens, start_pos, 8, inputs, dt_limit=(0.5, 0.6))
    ref, _, _ = ssd_oracle(*inputs, seq_lens, dt_limit=(0.5, 0.6))
    torch.testing.assert_close(limited.double(), ref, atol=1e-4, rtol=1e-4)
    unlimited, _, _, _ = run_c(seq_lens, start_pos, 8, inputs)
    assert not torch.allclose(limited, unlimited, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_c_scan_half_inputs_match_torch_path(dtype):
    seq_lens, start_pos, chunk = [19, 6], [0, 11], 8
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens, seed=4)
    half = (x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype), D, dt_bias, init)
    y, final, _, layout = run_c(seq_lens, start_pos, chunk, half)
    ref = ssd_scan_torch(*half, layout)
    assert y.dtype == dtype
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(y.float(), ref.y.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(final, ref.final_states, atol=1e-4, rtol=1e-4)


def test_strided_views_of_the_conv_output_need_no_copy_and_agree():
    """x / B / C as column views of one (T, conv_dim) float32 tensor, as the mixer passes them."""
    seq_lens, start_pos, chunk = [13, 4], [0, 6], 4
    H, P, G, N = 4, 8, 2, 6
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens, H, P, G, N, seed=5)
    T = x.shape[0]
    xbc = torch.cat([x.reshape(T, -1), B.reshape(T, -1), C.reshape(T, -1)], dim=1)
    xv, Bv, Cv = xbc.split([H * P, G * N, G * N], dim=1)
    views = (xv.view(T, H, P), dt, A, Bv.view(T, G, N), Cv.view(T, G, N), D, dt_bias, init)
    assert cpu_prefill._rows(views[0]).data_ptr() == xv.data_ptr()  # no copy
    y, final, _, _ = run_c(seq_lens, start_pos, chunk, views)
    y_ref, final_ref, _ = ssd_oracle(x, dt, A, B, C, D, dt_bias, init, seq_lens)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double(), final_ref, atol=1e-4, rtol=1e-4)


def test_bad_slot_is_an_error_and_writes_nothing():
    seq_lens = [5, 3]
    x, dt, A, B, C, D, dt_bias, _ = ssd_inputs(seq_lens, seed=6)
    layout = build_chunk_layout(seq_lens, [0, 0], 4, "cpu")
    pool = torch.randn(5, *x.shape[1:], B.shape[2])
    before = pool.clone()
    with pytest.raises(IndexError, match="slot index 9 of sequence 1 is outside the pool of 5"):
        cpu_prefill.ssd_prefill_cpu(
            x,
            dt.abs(),
            A,
            B,
            C,
            D,
            pool,
            torch.tensor([0, 9]),
            layout.cu_seqlens,
            layout.start_pos,
            4,
            layout.num_chunks,
        )
    assert torch.equal(pool, before)


def test_pool_entry_point_agrees_with_the_torch_fallback(monkeypatch):
    """ssd_scan_pool: the C scan, and the torch scan + scatter it replaces, leave the same pool
    and return the same rows; without chunk states asked for, the C path returns none."""
    seq_lens, start_pos, chunk = [10, 21, 2], [0, 37, 5], 8
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens, seed=7)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    slots = torch.tensor([4, 0, 2])
    pools = []
    for fused in (True, False):
        monkeypatch.setattr(cpu_prefill, "supported", lambda *a, fused=fused: fused)
        pool = torch.zeros(5, *init.shape[1:])
        pool[slots] = init
        y, states = ssd_scan_pool(x, dt, A, B, C, D, dt_bias, pool, slots, layout)
        pools.append((y, states, pool))
    (y_c, s_c, pool_c), (y_t, s_t, pool_t) = pools
    torch.testing.assert_close(y_c, y_t, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_c, s_t, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool_c, pool_t, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(cpu_prefill, "supported", lambda *a: True)
    pool = torch.zeros(5, *init.shape[1:])
    _, none = ssd_scan_pool(
        x, dt, A, B, C, D, dt_bias, pool, slots, layout, want_chunk_states=False
    )
    assert none is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 48])
def test_fused_gate_matches_torch_path(dtype, group):
    """The prefill gate norm(y * silu(z)) in C against kernels/norm.py's torch path, z a strided
    view of a wider projection as the mixer passes it; bf16 rounds where the torch path does."""
    g = torch.Generator().manual_seed(8)
    T, width = 37, 96
    y = (torch.randn(T, width, generator=g) * 3).to(dtype)
    zxbcdt = torch.randn(T, width + 20, generator=g).to(dtype)
    z = zxbcdt[:, 5 : 5 + width]
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    out = cpu_prefill.gated_rms_norm_cpu(y, z, weight, 1e-5, group)
    ref = gated_rms_norm_torch(y, z, weight, 1e-5, group)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out, ref)  # bf16 tolerance: one rounding step at most
        assert (out == ref).float().mean() > 0.97  # and nearly all bits equal
    with pytest.raises(ValueError, match="width 96 is not a multiple of the group 40"):
        cpu_prefill.gated_rms_norm_cpu(y, z, weight, 1e-5, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_conv_matches_oracle_and_torch_path(dtype, K, with_bias):
    """Varlen conv + SiLU in C: outputs, the pool's final windows and the checkpoint windows
    against the naive oracle (fp32) and the torch path (both dtypes); x a strided view, more
    channels than one C block, the sequences in scattered slots."""
    seq_lens, dim = [5, 1, 70, 3], 150
    g = torch.Generator().manual_seed(9)
    T = sum(seq_lens)
    wide = torch.randn(T, dim + 7, generator=g).to(dtype)
    x = wide[:, 3 : 3 + dim]
    w = torch.randn(dim, K, generator=g).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype) if with_bias else None
    init = torch.randn(len(seq_lens), dim, K - 1, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 5, 1])
    layout = build_window_layout(seq_lens, K, "cpu")
    window_tokens = torch.tensor([0, 4, 5, 30, 75, 78])
    results = []
    for fn in (cpu_prefill.causal_conv1d_varlen_cpu, causal_conv1d_varlen_torch):
        pool = torch.randn(6, dim, K - 1, generator=torch.Generator().manual_seed(1)).to(dtype)
        pool[slots] = init
        out, windows = fn(x, w, b, pool, slots, layout, window_tokens)
        results.append((out, windows, pool))
    (out, windows, pool), (out_t, windows_t, pool_t) = results
    assert out.dtype == dtype and windows.dtype == dtype
    tol = {} if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_t, **tol)
    torch.testing.assert_close(windows, windows_t, atol=0, rtol=0)  # inputs, copied
    torch.testing.assert_close(pool, pool_t, atol=0, rtol=0)  # other slots untouched too
    if dtype == torch.float32:
        ref, finals, per_tok = conv_oracle(x, w, b, init, seq_lens)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slots].double(), finals, atol=0, rtol=0)
        flat = [st for seq in per_tok for st in seq]
        for m, t in enumerate(window_tokens.tolist()):
            torch.testing.assert_close(windows[m].double(), flat[t], atol=0, rtol=0)


def test_fused_conv_bad_slot_is_an_error_and_writes_nothing():
    x = torch.randn(6, 8)
    pool = torch.randn(2, 8, 3)
    before = pool.clone()
    layout = build_window_layout([4, 2], 4, "cpu")
    with pytest.raises(IndexError, match="slot index 2 of sequence 1 is outside the pool of 2"):
        cpu_prefill.causal_conv1d_varlen_cpu(
            x, torch.randn(8, 4), None, pool, torch.tensor([0, 2]), layout
        )
    assert torch.equal(pool, before)


# The scan's chunk is four register-tiled GEMMs (tiles of 4 rows x up to 64 columns, masked
# tails): shapes whose P, N or chunk length are not multiples of the tile, more than one column
# panel (P or N > 64, a chunk > 64 tokens for C B^T), one token, and the 110M shape itself.
TILE_CASES = [
    # (seq_lens, start_pos, chunk, H, P, G, N)
    ([1], [0], 128, 2, 64, 1, 128),  # one token
    ([3, 130, 67], [0, 5, 128], 128, 3, 80, 3, 72),  # P, N: a full panel + a masked one
    ([100, 5], [0, 20], 128, 2, 17, 2, 33),  # l = 100: C B^T spans two column panels
    ([45, 2], [7, 0], 16, 4, 64, 2, 128),  # the 110M head shape, short chunks
    ([200], [0], 64, 2, 16, 1, 16),  # one sequence, one group: a task per head
]


@pytest.mark.parametrize("seq_lens,start_pos,chunk,H,P,G,N", TILE_CASES)
def test_c_scan_tile_tails_match_token_recurrence(seq_lens, start_pos, chunk, H, P, G, N):
    inputs = ssd_inputs(seq_lens, H=H, P=P, G=G, N=N, seed=11)
    y, final, chunk_states, layout = run_c(seq_lens, start_pos, chunk, inputs)
    y_ref, final_ref, per_token = ssd_oracle(*inputs, seq_lens)
    torch.testing.assert_close(y.double(), y_ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final.double(), final_ref, atol=2e-4, rtol=2e-4)
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        for c in range(layout.num_chunks):
            j = p0 - p0 % chunk + (c + 1) * chunk - p0 - 1
            expected = per_token[s][min(j, n - 1)]
            torch.testing.assert_close(chunk_states[s, c].double(), expected, atol=2e-4, rtol=2e-4)


def test_c_scan_zero_initial_states_skip_nothing_they_need():
    """A zero initial state skips the inter-chunk term of the first chunk; a state that is zero
    but for its very last entry, and a zero state resumed mid-chunk, must not."""
    seq_lens, start_pos, chunk = [20, 20, 9, 33], [0, 0, 3, 0], 8
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens, H=4, P=20, G=2, N=18, seed=12)
    init[0] = 0.0
    init[1] = 0.0
    init[1, -1, -1, -1] = 5.0  # the last element the zero check reads
    init[2] = 0.0
    inputs = (x, dt, A, B, C, D, dt_bias, init)
    y, final, _, _ = run_c(seq_lens, start_pos, chunk, inputs)
    y_ref, final_ref, _ = ssd_oracle(*inputs, seq_lens)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double(), final_ref, atol=1e-4, rtol=1e-4)


def test_plain_c_build_without_avx512_agrees(tmp_path, monkeypatch):
    """The portable tile (no AVX-512: -march=x86-64-v3, what a CPU without it compiles) gives the
    same scan and conv as the intrinsics build the rest of this file tests."""
    from baton.kernels.cpu import extension

    portable = extension.variant(PORTABLE_FLAGS, "baton_portable")
    assert portable is not None
    native = cpu_prefill.library()
    seq_lens, start_pos, chunk = [70, 3, 1], [0, 9, 5], 64
    inputs = ssd_inputs(seq_lens, H=4, P=24, G=2, N=40, seed=13)
    conv_x = torch.randn(sum(seq_lens), 150)
    conv_w = torch.randn(150, 4)
    layout = build_window_layout(seq_lens, 4, "cpu")
    results = []
    for lib in (portable, native):
        monkeypatch.setattr(cpu_prefill, "library", lambda lib=lib: lib)
        y, final, states, _ = run_c(seq_lens, start_pos, chunk, inputs)
        pool = torch.randn(3, 150, 3, generator=torch.Generator().manual_seed(2))
        out, _ = cpu_prefill.causal_conv1d_varlen_cpu(
            conv_x, conv_w, None, pool, torch.tensor([2, 0, 1]), layout
        )
        results.append((y, final, states, out, pool))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    y_ref, _, _ = ssd_oracle(*inputs, seq_lens)
    torch.testing.assert_close(results[0][0].double(), y_ref, atol=1e-4, rtol=1e-4)
