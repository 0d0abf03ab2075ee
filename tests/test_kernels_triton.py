"""Every Triton kernel, run by the interpreter (TRITON_INTERPRET=1, set in conftest) on CPU
tensors with BATON_KERNELS=triton, against the torch path and the naive oracles, in float32 and
float16. Each test also proves the Triton launcher really ran (the `triton_calls` spy)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from baton.kernels.attention import build_attention_layout, paged_attention, paged_attention_torch
from baton.kernels.conv1d import (
    build_window_layout,
    causal_conv1d_update,
    causal_conv1d_update_torch,
    causal_conv1d_varlen,
    causal_conv1d_varlen_torch,
)
from baton.kernels.norm import gated_rms_norm, gated_rms_norm_torch, rms_norm, rms_norm_torch
from baton.kernels.ssd import build_chunk_layout, ssd_scan, ssd_scan_torch
from baton.kernels.ssu import (
    selective_state_update,
    selective_state_update_multi,
    selective_state_update_torch,
)
from baton.kernels.state_copy import copy_states
from tests.oracles import attention_oracle, conv_oracle, ssd_oracle

LAUNCHERS = {
    "baton.kernels.triton.ssd": ["ssd_scan_triton"],
    "baton.kernels.triton.conv1d": ["causal_conv1d_varlen_triton", "causal_conv1d_update_triton"],
    "baton.kernels.triton.ssu": [
        "selective_state_update_triton",
        "selective_state_update_multi_triton",
    ],
    "baton.kernels.triton.attention": ["paged_attention_triton"],
    "baton.kernels.triton.state_copy": ["copy_states_triton"],
    "baton.kernels.triton.norm": ["rms_norm_triton", "gated_rms_norm_triton"],
}
DTYPES = [torch.float32, torch.float16]


@pytest.fixture
def triton_calls(monkeypatch) -> Counter:
    """Force the Triton backend and count launcher calls made through the public functions."""
    monkeypatch.setenv("BATON_KERNELS", "triton")
    calls: Counter = Counter()
    for module_name, names in LAUNCHERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            launcher = getattr(module, name)

            def spy(*args, _launcher=launcher, _name=name, **kwargs):
                calls[_name] += 1
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return calls


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **tol(dtype))


def ssd_inputs(seq_lens, H, P, G, N, dtype, seed=0, strided=False):
    """Activations (x, dt, B, C) in `dtype`; parameters and initial states in float32. With
    `strided`, x, B and C are column slices of one wide row, like the engine's xBC split."""
    g = torch.Generator().manual_seed(seed)
    T, S = sum(seq_lens), len(seq_lens)
    if strided:
        xbc = torch.randn(T, H * P + 2 * G * N + 3, generator=g).to(dtype)
        x = xbc[:, : H * P].view(T, H, P)
        B = xbc[:, H * P : H * P + G * N].view(T, G, N)
        C = xbc[:, H * P + G * N : H * P + 2 * G * N].view(T, G, N)
    else:
        x = torch.randn(T, H, P, generator=g).to(dtype)
        B = torch.randn(T, G, N, generator=g).to(dtype)
        C = torch.randn(T, G, N, generator=g).to(dtype)
    dt = torch.randn(T, H, generator=g).to(dtype)
    A = -torch.rand(H, generator=g) * 3 - 0.2
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    init = torch.randn(S, H, P, N, generator=g)
    return x, dt, A, B, C, D, dt_bias, init


# seq_lens, start_pos, chunk, (H, P, G, N): several sequences starting mid-chunk with initial
# states; dims that are not powers of two; the engine test's shapes (4 x 16, d_state 8,
# n_groups 2, chunk 16).
SSD_CASES = [
    ([9, 3, 17], [0, 5, 2], 4, (4, 8, 2, 6)),
    ([28, 1, 40], [100, 3, 64], 16, (4, 16, 2, 8)),
    ([5, 12], [13, 0], 8, (6, 12, 3, 5)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,start_pos,chunk,dims", SSD_CASES)
def test_ssd_scan_matches_torch_path_and_token_recurrence(
    triton_calls, seq_lens, start_pos, chunk, dims, dtype
):
    H, P, G, N = dims
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens, H, P, G, N, dtype, strided=True)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    out = ssd_scan(x, dt, A, B, C, D, dt_bias, init, layout)
    assert triton_calls["ssd_scan_triton"] == 1
    ref = ssd_scan_torch(x, dt, A, B, C, D, dt_bias, init, layout)
    assert out.y.dtype == dtype and out.final_states.dtype == torch.float32
    close(out.y, ref.y, dtype)
    close(out.final_states, ref.final_states, torch.float32)
    # All chunk entries, including the padded ones (a shorter sequence repeats its final state).
    close(out.chunk_states, ref.chunk_states, torch.float32)
    y_ref, final_ref, per_token = ssd_oracle(x, dt, A, B, C, D, dt_bias, init, seq_lens)
    close(out.y, y_ref, dtype)
    close(out.final_states, final_ref, torch.float32)
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        for c in range(layout.num_chunks):
            j = p0 - p0 % chunk + (c + 1) * chunk - p0 - 1  # last local token inside chunk c
            if 0 <= j < n:
                close(out.chunk_states[s, c], per_token[s][j], torch.float32)
            elif j >= n:
                close(out.chunk_states[s, c], final_ref[s], torch.float32)


def test_ssd_scan_applies_dt_limit(triton_calls):
    seq_lens = [6, 3]
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens, 4, 8, 2, 6, torch.float32)
    layout = build_chunk_layout(seq_lens, [2, 0], 4, "cpu")
    limited = ssd_scan(x, dt, A, B, C, D, dt_bias, init, layout, dt_limit=(0.5, 0.6))
    ref, _, _ = ssd_oracle(x, dt, A, B, C, D, dt_bias, init, seq_lens, dt_limit=(0.5, 0.6))
    close(limited.y, ref, torch.float32)
    unlimited = ssd_scan(x, dt, A, B, C, D, dt_bias, init, layout)
    assert not torch.allclose(limited.y, unlimited.y)
    assert triton_calls["ssd_scan_triton"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_state_update_writes_only_its_slots(triton_calls, dtype):
    H, P, G, N, slots = 4, 16, 2, 8, 7
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(slots, H, P, N, generator=g)
    before = pool.clone()
    idx = torch.tensor([3, 0, 5, 0])  # rows 1 and 3 are padding -> dummy slot 0
    x, dt, A, B, C, D, dt_bias, _ = ssd_inputs([4], H, P, G, N, dtype, seed=2, strided=True)
    y = selective_state_update(pool, x, dt, A, B, C, D, dt_bias, idx, (0.01, 5.0))
    assert triton_calls["selective_state_update_triton"] == 1
    torch_pool = before.clone()
    y_torch = selective_state_update_torch(torch_pool, x, dt, A, B, C, D, dt_bias, idx, (0.01, 5.0))
    for row, slot in enumerate(idx.tolist()):
        if slot == 0:
            continue
        one = slice(row, row + 1)
        inputs = (x[one], dt[one], A, B[one], C[one], D, dt_bias, before[slot : slot + 1])
        y_ref, final, _ = ssd_oracle(*inputs, [1], dt_limit=(0.01, 5.0))
        close(y[row], y_ref[0], dtype)
        close(y[row], y_torch[row], dtype)
        close(pool[slot], final[0], torch.float32)
    for untouched in (1, 2, 4, 6):
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_state_update_multi_writes_state_after_each_token(triton_calls, dtype):
    H, P, G, N, k = 4, 8, 2, 6, 3
    x, dt, A, B, C, D, dt_bias, _ = ssd_inputs([2 * k], H, P, G, N, dtype, seed=3)
    x, dt, B, C = (t.view(2, k, *t.shape[1:]) for t in (x, dt, B, C))
    pool = torch.randn(10, H, P, N)
    before = pool.clone()
    # Row 0 reads slot 1 and writes 4, 5, 6; row 1 is padding on the dummy slot.
    idx = torch.tensor([[1, 4, 5, 6], [0, 0, 0, 0]])
    y = selective_state_update_multi(pool, x, dt, A, B, C, D, dt_bias, idx)
    assert triton_calls["selective_state_update_multi_triton"] == 1
    y_ref, _, per_token = ssd_oracle(x[0], dt[0], A, B[0], C[0], D, dt_bias, before[1:2], [k])
    close(y[0], y_ref, dtype)
    for i in range(k):
        close(pool[4 + i], per_token[0][i], torch.float32)
    for untouched in (1, 2, 3, 7, 8, 9):
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [3, 4])
def test_conv_varlen_matches_oracle_and_updates_only_its_slots(triton_calls, K, dtype):
    seq_lens, dim = [5, 1, 9, 2], 40  # 1 and 2 tokens < K-1: the new state keeps old columns
    g = torch.Generator().manual_seed(4)
    xbc = torch.randn(sum(seq_lens), dim + 8, generator=g).to(dtype)
    x = xbc[:, 4 : 4 + dim]  # strided view, like the engine's split of in_proj
    w = torch.randn(dim, K, generator=g).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype)
    pool = torch.randn(7, dim, K - 1, generator=g).to(dtype)
    slots = torch.tensor([2, 4, 1, 6])
    init = pool[slots].clone()
    before = pool.clone()
    layout = build_window_layout(seq_lens, K, "cpu")
    window_tokens = torch.tensor([0, 4, 5, 8, 14, 15, 16])
    out, windows = causal_conv1d_varlen(x, w, b, pool, slots, layout, window_tokens)
    assert triton_calls["causal_conv1d_varlen_triton"] == 1
    torch_pool = before.clone()
    out_torch, windows_torch = causal_conv1d_varlen_torch(
        x, w, b, torch_pool, slots, layout, window_tokens
    )
    close(out, out_torch, dtype)
    assert torch.equal(windows, windows_torch) and torch.equal(pool, torch_pool)
    ref, finals, per_tok = conv_oracle(x, w, b, init, seq_lens)
    close(out, ref, dtype)
    close(pool[slots], finals, dtype)
    flat = [w_ for seq in per_tok for w_ in seq]
    for i, t in enumerate(window_tokens.tolist()):
        close(windows[i], flat[t], dtype)
    for untouched in (0, 3, 5):
        assert torch.equal(pool[untouched], before[untouched])
    # The decode step continues exactly where the varlen pass left off; row 2 is padding.
    x2 = torch.randn(3, dim, generator=g).to(dtype)
    step_slots = torch.tensor([2, 4, 0])
    kept = pool.clone()
    y2 = causal_conv1d_update(x2, w, None, pool, step_slots)
    assert triton_calls["causal_conv1d_update_triton"] == 1
    torch_pool = kept.clone()
    close(y2, causal_conv1d_update_torch(x2, w, None, torch_pool, step_slots), dtype)
    assert torch.equal(pool, torch_pool)
    for row in range(2):
        window = torch.cat([finals[row], x2[row].double()[:, None]], 1)
        close(y2[row], F.silu((window * w.double()).sum(1)), dtype)
        close(pool[step_slots[row]], window[:, 1:], dtype)
    for untouched in (1, 3, 5, 6):
        assert torch.equal(pool[untouched], kept[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms_match_torch_path(triton_calls, dtype):
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(5, 3 * 24, generator=g).to(dtype)
    y, z = wide[:, :24], wide[:, 24:48]  # strided views, like the engine's split
    w = torch.randn(24, generator=g).to(dtype)
    out = gated_rms_norm(y, z, w, 1e-5, group_size=12)
    h = (y.double() * F.silu(z.double())).view(5, 2, 12)
    ref = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(5, 24) * w.double()
    assert out.dtype == dtype
    close(out, ref, dtype)
    close(out, gated_rms_norm_torch(y, z, w, 1e-5, 12), dtype)
    x = wide[:, 48:]
    out = rms_norm(x, w, 1e-6)
    ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    close(out, ref, dtype)
    close(out, rms_norm_torch(x, w, 1e-6), dtype)
    assert triton_calls["gated_rms_norm_triton"] == 1 and triton_calls["rms_norm_triton"] == 1


def paged_kv(kv_lens, KVH, Dh, page, dtype, num_pages=24, seed=5):
    """K/V of each sequence scattered over shuffled pages (page 0, the dummy, is never used)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_pages * page, KVH, Dh, generator=g).to(dtype)  # garbage elsewhere
    v_cache = torch.randn(num_pages * page, KVH, Dh, generator=g).to(dtype)
    pages = torch.randperm(num_pages - 1, generator=g) + 1
    rows, used, keys, values = [], 0, [], []
    for n in kv_lens:
        need = -(-n // page)
        slots = (pages[used : used + need, None] * page + torch.arange(page)).flatten()[:n]
        used += need
        keys.append(k_cache[slots])
        values.append(v_cache[slots])
        rows.append(torch.cat([slots, torch.zeros(max(kv_lens) - n, dtype=torch.int64)]))
    return k_cache, v_cache, torch.stack(rows), keys, values


# q_lens, prefix lengths, (heads, kv heads, head_dim, page): decode, extend over a cached
# prefix, GQA with a group of 5 (not a power of two), the engine test's shapes (4 q / 2 kv heads
# of 16, page 16).
ATTENTION_CASES = [
    ([1, 1, 1], [4, 0, 9], (4, 2, 8, 4)),
    ([5, 1, 3], [0, 7, 2], (4, 2, 8, 4)),
    ([1, 1], [70, 3], (10, 2, 16, 16)),
    ([37, 3], [17, 40], (4, 2, 16, 16)),  # two query blocks of 32 rows
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,prefix,dims", ATTENTION_CASES)
def test_paged_attention_matches_oracle(triton_calls, q_lens, prefix, dims, dtype):
    H, KVH, Dh, page = dims
    kv_lens = [p + q for p, q in zip(prefix, q_lens)]
    k_cache, v_cache, kv_indices, keys, values = paged_kv(kv_lens, KVH, Dh, page, dtype)
    q = torch.randn(sum(q_lens), H, Dh, generator=torch.Generator().manual_seed(7)).to(dtype)
    layout = build_attention_layout(q_lens, kv_lens, kv_indices, "cpu")
    out = paged_attention(q, k_cache, v_cache, layout, scale=Dh**-0.5)
    assert triton_calls["paged_attention_triton"] == 1
    close(out, paged_attention_torch(q, k_cache, v_cache, layout, Dh**-0.5), dtype)
    t = 0
    for s, n in enumerate(q_lens):
        close(out[t : t + n], attention_oracle(q[t : t + n], keys[s], values[s], Dh**-0.5), dtype)
        t += n


@pytest.mark.parametrize("q_lens,prefix", [([1, 1, 1], [150, 2, 63]), ([6, 2], [40, 90])])
def test_paged_attention_split_keys_merge_exactly(q_lens, prefix):
    from baton.kernels.triton.attention import paged_attention_triton

    H, KVH, Dh, page = 4, 2, 16, 16
    kv_lens = [p + q for p, q in zip(prefix, q_lens)]
    k_cache, v_cache, kv_indices, keys, values = paged_kv(kv_lens, KVH, Dh, page, torch.float32)
    q = torch.randn(sum(q_lens), H, Dh, generator=torch.Generator().manual_seed(8))
    layout = build_attention_layout(q_lens, kv_lens, kv_indices, "cpu")
    whole = paged_attention_triton(q, k_cache, v_cache, layout, Dh**-0.5, num_splits=1)
    split = paged_attention_triton(q, k_cache, v_cache, layout, Dh**-0.5, num_splits=4)
    close(split, whole, torch.float32)
    close(split, paged_attention_torch(q, k_cache, v_cache, layout, Dh**-0.5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_states_fills_checkpoint_slots_only(triton_calls, dtype):
    g = torch.Generator().manual_seed(9)
    ssm_pool = torch.randn(6, 4, 8, 6, generator=g)
    chunk_states = torch.randn(2, 3, 4, 8, 6, generator=g)  # (seqs, chunks, H, P, N)
    before = ssm_pool.clone()
    copy_states(ssm_pool, torch.tensor([4, 2]), chunk_states.flatten(0, 1), torch.tensor([5, 1]))
    assert torch.equal(ssm_pool[4], chunk_states[1, 2])
    assert torch.equal(ssm_pool[2], chunk_states[0, 1])
    for untouched in (0, 1, 3, 5):
        assert torch.equal(ssm_pool[untouched], before[untouched])
    conv_pool = torch.randn(5, 12, 3, generator=g).to(dtype)
    kept = conv_pool.clone()
    copy_states(conv_pool, torch.tensor([3]), conv_pool, torch.tensor([1]))  # working -> checkpoint
    assert torch.equal(conv_pool[3], kept[1])
    windows = torch.randn(2, 12, 3, generator=g)  # float32 windows into a `dtype` pool
    copy_states(conv_pool, torch.tensor([4, 2]), windows, torch.tensor([1, 0]))
    assert torch.equal(conv_pool[4], windows[1].to(dtype))
    assert torch.equal(conv_pool[2], windows[0].to(dtype))
    for untouched in (0, 1):
        assert torch.equal(conv_pool[untouched], kept[untouched])
    assert triton_calls["copy_states_triton"] == 3


def test_every_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The interpreter proves semantics, not that a GPU build accepts the kernels: build every
    kernel to a cubin for sm_90 (H100/H200) in a fresh process, with a fresh Triton cache."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    env.pop("BATON_KERNELS", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.compile_check", "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernels compiled for sm_90" in done.stdout
