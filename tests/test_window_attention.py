"""Sliding-window attention over the paged cache (kernels/window_attention.py) against a float64
oracle that attends to the last `window` keys of each query only: decode through the narrowed
layout (the C decode kernel where built, the torch path otherwise), extend and verify through the
C extend kernel where built (each query's window read from the pages) and the masked path
otherwise, windows shorter and longer than the sequences, GQA and MQA. The slots behind every
window are poisoned with NaN (as if their pages had been released to the dummy page): nothing may
read them."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.attention import build_attention_layout
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.window_attention import window_attention, window_attention_masked

PAGE = 4


def window_oracle(q, keys, values, scale, window):
    """q: (Q, H, D) at the last Q positions of keys/values (L, KVH, D); query at position p sees
    keys p - window + 1 .. p. float64."""
    Q, H, _ = q.shape
    L, KVH, _ = keys.shape
    rep = H // KVH
    out = torch.zeros(Q, H, q.shape[2], dtype=torch.float64)
    for i in range(Q):
        pos = L - Q + i
        lo = max(0, pos - window + 1)
        for h in range(H):
            k = keys[lo : pos + 1, h // rep].double()
            v = values[lo : pos + 1, h // rep].double()
            out[i, h] = torch.softmax((k @ q[i, h].double()) * scale, dim=0) @ v
    return out


def paged_case(q_lens, kv_lens, heads, kv_heads, head_dim, window, seed):
    """Sequences with their K/V scattered over shuffled pages; the slots behind each sequence's
    earliest window are NaN. Returns (q, k_cache, v_cache, layout, per-sequence (keys, values))."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(-(-n // PAGE) for n in kv_lens)
    order = torch.randperm(num_pages - 1, generator=g) + 1
    k_cache = torch.randn(num_pages * PAGE, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_pages * PAGE, kv_heads, head_dim, generator=g)
    width = max(kv_lens)
    kv_indices = torch.zeros(len(kv_lens), width, dtype=torch.int64)
    seqs, used = [], 0
    for s, (n, ql) in enumerate(zip(kv_lens, q_lens)):
        pages = order[used : used + -(-n // PAGE)]
        used += len(pages)
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]
        kv_indices[s, :n] = slots
        seqs.append((k_cache[slots].clone(), v_cache[slots].clone()))
        dead = max(0, n - ql - window + 1)  # behind the first query's window
        k_cache[slots[:dead]] = float("nan")
        v_cache[slots[:dead]] = float("nan")
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    layout = build_attention_layout(list(q_lens), list(kv_lens), kv_indices, "cpu")
    return q, k_cache, v_cache, layout, seqs


@pytest.mark.parametrize(
    "q_lens, kv_lens, window",
    [
        ((1, 1, 1), (3, 17, 40), 8),  # decode: shorter, longer than the window
        ((1, 1), (5, 9), 1),  # a window of one token: a query sees itself
        ((1, 1), (30, 6), 64),  # a window longer than every sequence
        ((7, 16, 3), (7, 40, 25), 10),  # extend: from scratch, resumed past the window
        ((3, 3), (20, 9), 5),  # verify-like: q = 3 a sequence
    ],
)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1)])
def test_window_attention_matches_float64_oracle(q_lens, kv_lens, window, heads, kv_heads):
    q, k_cache, v_cache, layout, seqs = paged_case(q_lens, kv_lens, heads, kv_heads, 8, window, 3)
    out = window_attention(q, k_cache, v_cache, layout, 0.3, window)
    assert torch.isfinite(out).all()  # nothing behind a window was read
    start = 0
    for ql, (keys, values) in zip(q_lens, seqs):
        want = window_oracle(q[start : start + ql], keys, values, 0.3, window)
        torch.testing.assert_close(out[start : start + ql].double(), want, atol=1e-5, rtol=1e-5)
        start += ql


def test_decode_takes_the_c_kernel_where_built_and_matches_the_torch_path(monkeypatch):
    """The narrowed decode layout is what the C decode kernel reads (no mask); the torch path
    reads the layout's mask: both give the oracle's answer."""
    q, k_cache, v_cache, layout, _ = paged_case((1, 1, 1), (2, 19, 33), 4, 2, 8, 6, 5)
    fast = window_attention(q, k_cache, v_cache, layout, 0.3, 6)
    monkeypatch.setattr(cpu_ops, "decode_attention_supported", lambda *a: False)
    torch_path = window_attention(q, k_cache, v_cache, layout, 0.3, 6)
    torch.testing.assert_close(fast, torch_path, atol=1e-5, rtol=1e-5)


def test_decode_window_layout_runs_the_triton_decode_kernel():
    """On a GPU decode goes through the Triton paged kernel with the narrowed layout (here in
    the interpreter, tests/conftest.py): the oracle's answer, nothing behind a window read."""
    from baton.kernels.triton.attention import paged_attention_triton
    from baton.kernels.window_attention import decode_window_layout

    q, k_cache, v_cache, layout, seqs = paged_case((1, 1), (3, 21), 4, 2, 8, 8, 7)
    out = paged_attention_triton(q, k_cache, v_cache, decode_window_layout(layout, 8), 0.3)
    assert torch.isfinite(out).all()
    for s, (keys, values) in enumerate(seqs):
        want = window_oracle(q[s : s + 1], keys, values, 0.3, 8)
        torch.testing.assert_close(out[s : s + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64])  # the C kernel's portable loop, its AVX-512 items
@pytest.mark.parametrize(
    "q_lens, kv_lens, window",
    [
        ((37, 16, 3, 9), (37, 60, 25, 9), 10),  # from scratch past the window, resumed, short
        ((5, 5), (5, 12), 1),  # a window of one token: a query sees itself
        ((4, 4, 4), (30, 4, 11), 3),  # verify-like rows, several queries an AVX-512 item
    ],
)
@pytest.mark.parametrize("heads, kv_heads", [(12, 4), (4, 2), (3, 1)])
def test_extend_takes_the_c_kernel_where_built_and_matches_the_oracle(
    monkeypatch, head_dim, q_lens, kv_lens, window, heads, kv_heads
):
    """Extend and verify rows run the C extend kernel with the window (each query's own window
    start, also inside an AVX-512 item of consecutive queries): the oracle's answer, nothing
    behind a window read (NaN there), and the masked SDPA path's answer."""
    q, k_cache, v_cache, layout, seqs = paged_case(
        q_lens, kv_lens, heads, kv_heads, head_dim, window, 11
    )
    if not cpu_ops.decode_attention_supported(q, k_cache):
        pytest.skip("the C kernels are not built here")
    windows = []
    fused = cpu_ops.extend_attention_cpu
    monkeypatch.setattr(
        cpu_ops, "extend_attention_cpu", lambda *a: windows.append(a[-1]) or fused(*a)
    )
    out = window_attention(q, k_cache, v_cache, layout, 0.3, window)
    assert windows == [window]
    assert torch.isfinite(out).all()
    start = 0
    for ql, (keys, values) in zip(q_lens, seqs):
        want = window_oracle(q[start : start + ql], keys, values, 0.3, window)
        torch.testing.assert_close(out[start : start + ql].double(), want, atol=1e-5, rtol=1e-5)
        start += ql
    masked = window_attention_masked(q, k_cache, v_cache, layout, 0.3, window)
    torch.testing.assert_close(out, masked, atol=1e-5, rtol=1e-5)
