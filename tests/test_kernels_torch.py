"""The torch path of every kernel against the naive token-by-token oracles."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.attention import build_attention_layout, paged_attention, store_kv
from baton.kernels.conv1d import build_window_layout, causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.norm import gated_rms_norm
from baton.kernels.ssd import build_chunk_layout, ssd_scan
from baton.kernels.ssu import selective_state_update, selective_state_update_multi
from tests.oracles import attention_oracle, conv_oracle, ssd_oracle


def ssd_inputs(seq_lens, H=4, P=8, G=2, N=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, S = sum(seq_lens), len(seq_lens)
    x = torch.randn(T, H, P, generator=g)
    dt = torch.randn(T, H, generator=g)
    A = -torch.rand(H, generator=g) * 3 - 0.2
    B = torch.randn(T, G, N, generator=g)
    C = torch.randn(T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    init = torch.randn(S, H, P, N, generator=g)
    return x, dt, A, B, C, D, dt_bias, init


@pytest.mark.parametrize(
    "seq_lens,start_pos,chunk",
    [
        ([1], [0], 4),
        ([7], [0], 4),
        ([8], [0], 4),
        ([9, 3, 17], [0, 5, 2], 4),
        ([28, 1, 40], [100, 3, 64], 16),
        ([5, 12], [13, 0], 8),
    ],
)
def test_ssd_matches_token_recurrence(seq_lens, start_pos, chunk):
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens)
    layout = build_chunk_layout(seq_lens, start_pos, chunk, "cpu")
    out = ssd_scan(x, dt, A, B, C, D, dt_bias, init, layout)
    y_ref, final_ref, per_token = ssd_oracle(x, dt, A, B, C, D, dt_bias, init, seq_lens)
    torch.testing.assert_close(out.y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.final_states.double(), final_ref, atol=1e-4, rtol=1e-4)
    # States at chunk ends are true states of the sequence at absolute multiples of `chunk`.
    for s, (n, p0) in enumerate(zip(seq_lens, start_pos)):
        first_chunk_start = p0 - p0 % chunk
        for c in range(layout.num_chunks):
            end = first_chunk_start + (c + 1) * chunk  # absolute position after the chunk
            j = end - p0 - 1  # local index of the last token inside the chunk
            if 0 <= j < n:
                torch.testing.assert_close(
                    out.chunk_states[s, c].double(), per_token[s][j], atol=1e-4, rtol=1e-4
                )


def test_ssd_dt_limit_is_applied():
    seq_lens = [6]
    x, dt, A, B, C, D, dt_bias, init = ssd_inputs(seq_lens)
    layout = build_chunk_layout(seq_lens, [0], 4, "cpu")
    limited = ssd_scan(x, dt, A, B, C, D, dt_bias, init, layout, dt_limit=(0.5, 0.6))
    ref, _, _ = ssd_oracle(x, dt, A, B, C, D, dt_bias, init, seq_lens, dt_limit=(0.5, 0.6))
    unlimited = ssd_scan(x, dt, A, B, C, D, dt_bias, init, layout)
    torch.testing.assert_close(limited.y.double(), ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(limited.y, unlimited.y)


def test_selective_state_update_writes_only_its_slots():
    H, P, G, N, slots = 4, 8, 2, 6, 6
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(slots, H, P, N, generator=g)
    before = pool.clone()
    idx = torch.tensor([3, 0, 5])  # row 1 is padding -> dummy slot 0
    x, dt, A, B, C, D, dt_bias, _ = ssd_inputs([3], H, P, G, N, seed=2)
    y = selective_state_update(pool, x, dt, A, B, C, D, dt_bias, idx)
    for row, slot in enumerate(idx.tolist()):
        if slot == 0:
            continue
        y_ref, final, _ = ssd_oracle(
            x[row : row + 1],
            dt[row : row + 1],
            A,
            B[row : row + 1],
            C[row : row + 1],
            D,
            dt_bias,
            before[slot : slot + 1],
            [1],
        )
        torch.testing.assert_close(y[row].double(), y_ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slot].double(), final[0], atol=1e-5, rtol=1e-5)
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], before[untouched])


def test_selective_state_update_multi_writes_state_after_each_token():
    H, P, G, N, k = 4, 8, 2, 6, 3
    x, dt, A, B, C, D, dt_bias, _ = ssd_inputs([k], H, P, G, N, seed=3)
    pool = torch.zeros(8, H, P, N)
    pool[1] = torch.randn(H, P, N)
    start = pool[1].clone()
    idx = torch.tensor([[1, 4, 5, 6]])
    y = selective_state_update_multi(pool, x[None], dt[None], A, B[None], C[None], D, dt_bias, idx)
    y_ref, _, per_token = ssd_oracle(x, dt, A, B, C, D, dt_bias, start[None], [k])
    torch.testing.assert_close(y[0].double(), y_ref, atol=1e-5, rtol=1e-5)
    for i in range(k):
        torch.testing.assert_close(pool[4 + i].double(), per_token[0][i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], start)


@pytest.mark.parametrize("K", [3, 4])
def test_conv_varlen_matches_oracle_and_updates_pool(K):
    seq_lens, dim = [5, 1, 9], 6
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(seq_lens), dim, generator=g)
    w = torch.randn(dim, K, generator=g)
    b = torch.randn(dim, generator=g)
    pool = torch.randn(5, dim, K - 1, generator=g)
    slots = torch.tensor([2, 4, 1])
    init = pool[slots].clone()
    before = pool.clone()
    layout = build_window_layout(seq_lens, K, "cpu")
    window_tokens = torch.tensor([0, 4, 5, 8, 14])
    out, windows = causal_conv1d_varlen(x, w, b, pool, slots, layout, window_tokens)
    ref, finals, per_tok = conv_oracle(x, w, b, init, seq_lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots].double(), finals, atol=1e-6, rtol=1e-6)
    flat = [w_ for seq in per_tok for w_ in seq]
    for i, t in enumerate(window_tokens.tolist()):
        torch.testing.assert_close(windows[i].double(), flat[t], atol=1e-6, rtol=1e-6)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[3], before[3])
    # Decode step continues exactly where the varlen pass left off.
    x2 = torch.randn(3, dim, generator=g)
    y2 = causal_conv1d_update(x2, w, b, pool, slots)
    for row in range(3):
        window = torch.cat([finals[row], x2[row].double()[:, None]], 1)
        expect = torch.nn.functional.silu((window * w.double()).sum(1) + b.double())
        torch.testing.assert_close(y2[row].double(), expect, atol=1e-5, rtol=1e-5)


def test_conv_update_leaves_unused_slots_untouched():
    dim, K = 4, 4
    pool = torch.randn(4, dim, K - 1)
    before = pool.clone()
    causal_conv1d_update(torch.randn(2, dim), torch.randn(dim, K), None, pool, torch.tensor([2, 0]))
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[3], before[3])
    assert not torch.equal(pool[2], before[2])


def test_gated_rms_norm_groups():
    y, z = torch.randn(3, 8), torch.randn(3, 8)
    w = torch.randn(8)
    out = gated_rms_norm(y, z, w, 1e-5, group_size=4)
    h = (y * torch.nn.functional.silu(z)).view(3, 2, 4)
    ref = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 8) * w
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,prefix", [([1, 1, 1], [4, 0, 9]), ([5, 1, 3], [0, 7, 2])])
def test_paged_attention_matches_oracle(q_lens, prefix, dtype):
    H, KVH, Dh, page = 4, 2, 8, 4
    g = torch.Generator().manual_seed(5)
    num_slots = 64
    k_cache = torch.zeros(num_slots, KVH, Dh)
    v_cache = torch.zeros(num_slots, KVH, Dh)
    kv_lens = [p + q for p, q in zip(prefix, q_lens)]
    # Scatter each sequence over shuffled pages (page 0 is the dummy page).
    pages = torch.randperm(num_slots // page - 1, generator=g) + 1
    rows, used, all_k, all_v = [], 0, [], []
    max_kv = max(kv_lens)
    for n in kv_lens:
        need = (n + page - 1) // page
        my_pages = pages[used : used + need]
        used += need
        slots = (my_pages[:, None] * page + torch.arange(page)).flatten()[:n]
        keys, vals = torch.randn(n, KVH, Dh, generator=g), torch.randn(n, KVH, Dh, generator=g)
        k_cache[slots], v_cache[slots] = keys, vals
        all_k.append(keys)
        all_v.append(vals)
        rows.append(torch.cat([slots, torch.zeros(max_kv - n, dtype=torch.int64)]))
    kv_indices = torch.stack(rows)
    q = torch.randn(sum(q_lens), H, Dh, generator=g)
    layout = build_attention_layout(q_lens, kv_lens, kv_indices, "cpu")
    # bf16 decode upcasts on the CPU (kernels/attention.py); the oracle sees the rounded inputs.
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    all_k = [k.to(dtype).float() for k in all_k]
    all_v = [v.to(dtype).float() for v in all_v]
    out = paged_attention(q, k_cache, v_cache, layout, scale=Dh**-0.5)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    t = 0
    for s, n in enumerate(q_lens):
        ref = attention_oracle(q[t : t + n].float(), all_k[s], all_v[s], Dh**-0.5)
        torch.testing.assert_close(out[t : t + n].double(), ref, atol=tol, rtol=tol)
        t += n


def test_store_kv_writes_slots():
    k_cache, v_cache = torch.zeros(8, 1, 2), torch.zeros(8, 1, 2)
    k, v = torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2)
    store_kv(k_cache, v_cache, k, v, torch.tensor([3, 6]))
    assert k_cache[3].eq(1).all() and v_cache[6].eq(2).all() and k_cache[0].eq(0).all()
