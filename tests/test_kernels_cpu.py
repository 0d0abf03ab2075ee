"""The fused C decode kernels (kernels/cpu/ops.c) and the prepacked linears (kernels/linear.py)
against the torch path they replace. The token-by-token oracles in test_kernels_torch.py run
through the public dispatchers, so they cover the C kernels too whenever those are built."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels.conv1d import causal_conv1d_update, causal_conv1d_update_torch
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.linear import PackedLinear, can_pack, matmul_params, pack_linears
from baton.kernels.ssd import discretize_dt
from baton.kernels.ssu import selective_state_update, selective_state_update_torch

needs_cc = pytest.mark.skipif(
    cpu_ops.library() is None,
    reason="no C compiler (" + str(shutil.which("cc")) + "): the torch path runs instead",
)


def ssu_inputs(batch, H, P, G, N, slots, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots, H, P, N, generator=g)
    x = torch.randn(batch, H, P, generator=g).to(dtype)
    dt = torch.randn(batch, H, generator=g).to(dtype)
    A = -torch.rand(H, generator=g) * 4
    B = torch.randn(batch, G, N, generator=g).to(dtype)
    C = torch.randn(batch, G, N, generator=g).to(dtype)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g)
    return pool, x, dt, A, B, C, D, dt_bias


@needs_cc
@pytest.mark.parametrize(
    "H,P,G,N,dtype",
    [(4, 8, 2, 6, torch.float32), (6, 5, 3, 7, torch.float32), (24, 64, 8, 128, torch.bfloat16)],
)
def test_fused_ssu_matches_torch_path(H, P, G, N, dtype):
    batch, num_slots = 5, 9
    pool, x, dt, A, B, C, D, dt_bias = ssu_inputs(batch, H, P, G, N, num_slots, dtype)
    slots = torch.tensor([7, 2, 5, 1, 8])
    ref_pool = pool.clone()
    limit = (0.01, 2.0)
    y_ref = selective_state_update_torch(ref_pool, x, dt, A, B, C, D, dt_bias, slots, limit)
    y = cpu_ops.selective_state_update_cpu(
        pool, x, discretize_dt(dt, dt_bias, limit), A, B, C, D, slots
    )
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)
    for untouched in (0, 3, 4, 6):
        assert torch.equal(pool[untouched], ref_pool[untouched])


@needs_cc
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_conv_update_matches_torch_path(K, pool_dtype, with_bias):
    g = torch.Generator().manual_seed(K)
    dim, batch = 37, 4
    pool = torch.randn(6, dim, K - 1, generator=g).to(pool_dtype)
    ref_pool = pool.clone()
    x = torch.randn(batch, dim, generator=g).to(pool_dtype)
    w = torch.randn(dim, K, generator=g).to(pool_dtype)
    b = torch.randn(dim, generator=g).to(pool_dtype) if with_bias else None
    slots = torch.tensor([3, 1, 5, 2])
    y_ref = causal_conv1d_update_torch(x, w, b, ref_pool, slots)
    y = cpu_ops.causal_conv1d_update_cpu(x, w, b, pool, slots)
    tol = 1e-5 if pool_dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(pool, ref_pool)  # the shifted window is exact in any dtype


@needs_cc
def test_fused_kernels_reject_out_of_range_slots_without_writing():
    pool, x, dt, A, B, C, D, dt_bias = ssu_inputs(3, 4, 8, 2, 6, 5, torch.float32)
    before = pool.clone()
    for bad in (5, -1):
        with pytest.raises(IndexError, match=f"slot index {bad} of row 2 is outside the pool of 5"):
            selective_state_update(pool, x, dt, A, B, C, D, dt_bias, torch.tensor([1, 2, bad]))
    assert torch.equal(pool, before)
    conv = torch.randn(4, 6, 3)
    conv_before = conv.clone()
    with pytest.raises(IndexError, match="slot index 9 of row 0"):
        causal_conv1d_update(torch.randn(2, 6), torch.randn(6, 4), None, conv, torch.tensor([9, 1]))
    assert torch.equal(conv, conv_before)


@needs_cc
def test_dispatchers_use_the_fused_kernels_on_the_cpu(monkeypatch):
    """Prove the C path is what the model runs: a broken fused kernel must break the public
    functions (and the torch path must still agree once the fused kernels are disabled)."""

    def broken(*args, **kwargs):
        raise RuntimeError("fused kernel called")

    monkeypatch.setattr(cpu_ops, "selective_state_update_cpu", broken)
    monkeypatch.setattr(cpu_ops, "causal_conv1d_update_cpu", broken)
    pool, x, dt, A, B, C, D, dt_bias = ssu_inputs(2, 4, 8, 2, 6, 4, torch.float32)
    with pytest.raises(RuntimeError, match="fused kernel called"):
        selective_state_update(pool, x, dt, A, B, C, D, dt_bias, torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="fused kernel called"):
        causal_conv1d_update(
            torch.randn(2, 6), torch.randn(6, 4), None, torch.randn(4, 6, 3), torch.tensor([1, 2])
        )
    monkeypatch.setenv("BATON_CPU_OPS", "0")
    cpu_ops.library.cache_clear()
    try:
        assert cpu_ops.library() is None
        y = selective_state_update(pool, x, dt, A, B, C, D, dt_bias, torch.tensor([1, 2]))
        assert y.shape == x.shape
    finally:
        monkeypatch.delenv("BATON_CPU_OPS")
        cpu_ops.library.cache_clear()
    assert cpu_ops.library() is not None


def test_broken_compiler_falls_back_to_torch(monkeypatch, tmp_path):
    """Without a compiler the build says so (the message names it) and the library is None,
    so the public functions run their torch path and agree with it."""
    from baton.kernels.cpu import extension

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no-such-cc"):
        extension.build()
    monkeypatch.setattr(cpu_ops, "library", lambda: None)
    pool, x, dt, A, B, C, D, dt_bias = ssu_inputs(2, 4, 8, 2, 6, 4, torch.float32)
    ref_pool = pool.clone()
    y = selective_state_update(pool, x, dt, A, B, C, D, dt_bias, torch.tensor([1, 3]))
    y_ref = selective_state_update_torch(ref_pool, x, dt, A, B, C, D, dt_bias, torch.tensor([1, 3]))
    assert torch.equal(y, y_ref) and torch.equal(pool, ref_pool)


@needs_cc
def test_a_changed_shared_header_rebuilds_the_library(monkeypatch, tmp_path):
    """The kernels include cpu/common.h: the cache key covers the headers beside the sources,
    or an edit there would keep loading the stale library. The compiler is stubbed (each of its
    commands just writes its `-o` file): what is under test is which builds run, not gcc (the
    real build is tests/test_startup.py's `make install`)."""
    from baton.kernels.cpu import extension

    commands = []

    def compiler(command: list[str]) -> None:
        commands.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"")

    monkeypatch.setattr(extension, "_run", compiler)
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text('#include "k.h"\nint baton_answer(void) { return ANSWER; }\n')
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    built, runs = [], []
    for value in (41, 42, 42):
        (src / "k.h").write_text(f"#define ANSWER {value}\n")
        built.append(extension.build([src / "k.c"], namespace="baton_header_test"))
        runs.append(len(commands))
    assert built[0] != built[1] and built[1] == built[2]
    assert all(path.exists() for path in built)
    # two builds of three commands (the kernel, the shim, the link); the third was cached
    assert runs == [3, 6, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_packed_linear_matches_f_linear(dtype, rows):
    if not can_pack(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} on this CPU")
    torch.manual_seed(rows)
    linear = nn.Linear(48, 33, bias=True).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 48).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        packed(x), F.linear(x, linear.weight, linear.bias), atol=tol, rtol=tol
    )
    strided = torch.randn(rows, 96).to(dtype)[:, ::2]
    torch.testing.assert_close(
        packed(strided), F.linear(strided, linear.weight, linear.bias), atol=tol, rtol=tol
    )


def test_pack_linears_swaps_every_linear_and_keeps_the_math():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    expect = model(x)
    params = matmul_params(model)
    assert pack_linears(model, torch.float32) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert matmul_params(model) == params == 8 * 16 + 16 * 4
    torch.testing.assert_close(model(x), expect)
    assert pack_linears(nn.Linear(2, 2).half(), torch.float16) == 0  # not packable: left alone


@needs_cc
def test_argmax_rows_matches_torch_including_ties_nan_and_strides():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 1000, generator=g)
    logits[0, 17] = logits[0, 900] = 50.0  # tie: the first index wins
    logits[1, 999] = 50.0  # last column
    logits[2, 0] = 50.0  # first column
    logits[3] = -torch.inf
    logits[4, 300] = torch.nan  # torch ranks NaN highest
    logits[5, :] = 1.0
    logits[6, 255:257] = 60.0  # tie across the kernel's block boundary
    assert torch.equal(cpu_ops.argmax_rows(logits), logits.argmax(dim=-1))
    wide = torch.randn(5, 2048, generator=g)
    strided = wide[:, :1500]  # rows with a stride larger than their length
    assert torch.equal(cpu_ops.argmax_rows(strided), strided.argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax_rows(logits[:0]), logits[:0].argmax(dim=-1))


def composite_decode(zxbcdt, conv, ssm, slots, w, cb, A, D, dt_bias, norm_w, dims, limit, eps):
    """The torch path the fused kernel replaces: conv update, SSU, gated norm."""
    H, P, G, N, group = dims
    I = H * P
    z, xbc, dt = zxbcdt.split([I, I + 2 * G * N, H], dim=-1)
    xbc = causal_conv1d_update_torch(xbc, w, cb, conv, slots)
    x, B, C = xbc.split([I, G * N, G * N], dim=-1)
    b = zxbcdt.shape[0]
    y = selective_state_update_torch(
        ssm,
        x.reshape(b, H, P),
        dt,
        A,
        B.reshape(b, G, N),
        C.reshape(b, G, N),
        D,
        dt_bias,
        slots,
        limit,
    )
    from baton.kernels.norm import gated_rms_norm_torch

    return gated_rms_norm_torch(y.reshape(b, I), z, norm_w, eps, group)


@needs_cc
@pytest.mark.parametrize(
    "H,P,G,N,K,bias,group_div",
    [(4, 8, 2, 6, 4, True, 2), (6, 5, 3, 7, 3, False, 3), (24, 16, 8, 32, 4, True, 8)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mamba_decode_matches_the_composite_torch_path(H, P, G, N, K, bias, group_div, dtype):
    g = torch.Generator().manual_seed(H + K)
    I, batch, num_slots = H * P, 5, 8
    conv_dim = I + 2 * G * N
    zxbcdt = torch.randn(batch, I + conv_dim + H + 3, generator=g)[:, : I + conv_dim + H]
    zxbcdt = zxbcdt.to(dtype)  # rows with a stride wider than the row, like a split view
    conv = torch.randn(num_slots, conv_dim, K - 1, generator=g).to(dtype)
    ssm = torch.randn(num_slots, H, P, N, generator=g)
    w = torch.randn(conv_dim, K, generator=g).to(dtype)
    cb = torch.randn(conv_dim, generator=g).to(dtype) if bias else None
    A = -torch.rand(H, generator=g) * 3
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    norm_w = (1 + 0.1 * torch.randn(I, generator=g)).to(dtype)
    slots = torch.tensor([6, 1, 3, 7, 2])
    limit, eps, group = (0.001, 5.0), 1e-5, I // group_div
    params = cpu_ops.MambaDecodeParams(
        conv_weight=w.float(),
        conv_bias=cb.float() if bias else torch.zeros(conv_dim),
        dt_bias=dt_bias,
        A=A,
        D=D,
        norm_weight=norm_w.float(),
    )
    assert cpu_ops.mamba_decode_supported(zxbcdt, conv, ssm)
    conv_f, ssm_f = conv.clone(), ssm.clone()
    out = cpu_ops.mamba_decode_cpu(
        zxbcdt,
        conv_f,
        ssm_f,
        slots,
        params,
        limit,
        eps,
        num_heads=H,
        head_dim=P,
        n_groups=G,
        d_state=N,
        norm_group=group,
    )
    dims = (H, P, G, N, group)
    if dtype == torch.float32:
        conv_t, ssm_t = conv.clone(), ssm.clone()
        ref = composite_decode(
            zxbcdt, conv_t, ssm_t, slots, w, cb, A, D, dt_bias, norm_w, dims, limit, eps
        )
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ssm_f, ssm_t, atol=2e-5, rtol=2e-5)
    else:
        # bf16 rounds differently inside the conv; both paths must sit near a float32 run
        # of the same (rounded) inputs.
        conv_t, ssm_t = conv.float(), ssm.clone()
        ref = composite_decode(
            zxbcdt.float(),
            conv_t,
            ssm_t,
            slots,
            w.float(),
            cb.float() if bias else None,
            A,
            D,
            dt_bias,
            norm_w.float(),
            dims,
            limit,
            eps,
        )
        torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
        torch.testing.assert_close(ssm_f, ssm_t, atol=0.05, rtol=0.02)
    torch.testing.assert_close(conv_f.float(), conv_t.float(), atol=0, rtol=0)  # exact shift
    for untouched in (0, 4, 5):
        assert torch.equal(ssm_f[untouched], ssm[untouched])
        assert torch.equal(conv_f[untouched], conv[untouched])
    with pytest.raises(IndexError, match="slot index 8 of row 1"):
        cpu_ops.mamba_decode_cpu(
            zxbcdt[:2],
            conv_f,
            ssm_f,
            torch.tensor([1, 8]),
            params,
            limit,
            eps,
            num_heads=H,
            head_dim=P,
            n_groups=G,
            d_state=N,
            norm_group=group,
        )


@needs_cc
def test_engine_decode_runs_the_fused_kernel_and_matches_the_composite_path(
    base_model, monkeypatch
):
    """The CPU engine's decode steps go through baton_mamba_decode; with it disabled
    (BATON_CPU_OPS=0: conv update + SSU + gated norm in torch) the tokens and logprobs agree."""
    from baton import LLM, SamplingParams

    model_dir, _ = base_model
    prompts = [[3 + (7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    calls = []
    fused = cpu_ops.mamba_decode_cpu

    def spy(zxbcdt, *args, **kwargs):
        calls.append(zxbcdt.shape[0])
        return fused(zxbcdt, *args, **kwargs)

    monkeypatch.setattr(cpu_ops, "mamba_decode_cpu", spy)
    with_kernel = LLM(str(model_dir), dtype="float32").generate(prompts, params)
    assert calls and max(calls) == len(prompts)  # batched decode rows went through it
    monkeypatch.setenv("BATON_CPU_OPS", "0")
    cpu_ops.library.cache_clear()
    try:
        calls.clear()
        without = LLM(str(model_dir), dtype="float32").generate(prompts, params)
        assert calls == []
    finally:
        monkeypatch.delenv("BATON_CPU_OPS")
        cpu_ops.library.cache_clear()
    for a, b in zip(with_kernel, without):
        assert a.token_ids == b.token_ids
        chosen_a = [lp[t] for lp, t in zip(a.logprobs, a.token_ids)]
        chosen_b = [lp[t] for lp, t in zip(b.logprobs, b.token_ids)]
        assert max(abs(x - y) for x, y in zip(chosen_a, chosen_b)) < 1e-4


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_torch_path(dtype):
    from baton.kernels.norm import rms_norm, rms_norm_torch

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 80, generator=g).to(dtype)
    x = wide[:, :37]  # rows with a stride wider than the row
    w = (1 + 0.1 * torch.randn(37, generator=g)).to(dtype)
    assert cpu_ops.rms_norm_supported(x)
    out = rms_norm(x, w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), rms_norm_torch(x, w, 1e-5).float(), atol=tol, rtol=tol)
    assert out.dtype == dtype and out.is_contiguous()


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("H", "KVH", "Dh"),
    [
        (6, 2, 16),  # the AVX-512 item kernel: Dh a multiple of 16, <= 8 heads per KV head
        (8, 2, 64),
        (4, 4, 128),  # no grouping
        (16, 2, 80),  # 8 per KV head; a 16-column tail after the first 64
        (6, 2, 40),  # the portable loop: Dh not a multiple of 16
        (12, 1, 16),  # the portable loop: 12 per KV head
    ],
)
def test_decode_attention_reads_the_paged_cache_like_the_gather_path(
    dtype, H, KVH, Dh, monkeypatch
):
    from baton.kernels.attention import build_attention_layout, paged_attention

    g = torch.Generator().manual_seed(11)
    S, slots = 5, 200
    k_cache = torch.randn(slots, KVH, Dh, generator=g).to(dtype)
    v_cache = torch.randn(slots, KVH, Dh, generator=g).to(dtype)
    kv_lens = [1, 7, 33, 2, 19]
    kv_indices = torch.zeros(S, 40, dtype=torch.int64)  # padding columns point at slot 0
    for s, n in enumerate(kv_lens):
        kv_indices[s, :n] = torch.randperm(slots - 1, generator=g)[:n] + 1
    layout = build_attention_layout([1] * S, kv_lens, kv_indices, "cpu")
    q = torch.randn(S, H, Dh, generator=g).to(dtype)
    calls = []
    fused = cpu_ops.decode_attention_cpu
    monkeypatch.setattr(cpu_ops, "decode_attention_cpu", lambda *a: calls.append(1) or fused(*a))
    out = paged_attention(q, k_cache, v_cache, layout, 0.25)
    assert calls == [1]
    # A float64 softmax per sequence (paged_attention_torch would run this same kernel on
    # float32 decode queries, so it cannot be the reference).
    ref = []
    for s, n in enumerate(kv_lens):
        k = k_cache[kv_indices[s, :n]].double().repeat_interleave(H // KVH, dim=1)
        v = v_cache[kv_indices[s, :n]].double().repeat_interleave(H // KVH, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[s].double(), k) * 0.25).softmax(-1)
        ref.append(torch.einsum("hn,nhd->hd", weights, v))
    ref = torch.stack(ref).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    bad = kv_indices.clone()
    bad[3, 1] = slots
    bad_layout = build_attention_layout([1] * S, kv_lens, bad, "cpu")
    with pytest.raises(IndexError, match="sequence 3 has a token slot outside the cache"):
        paged_attention(q, k_cache, v_cache, bad_layout, 0.25)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("H", "KVH", "Dh"),
    # 8 queries a block at 1 head per KV head, 4 at 2, 2 at 3 and 4, 1 at 8; the portable loop
    [(4, 4, 128), (8, 4, 32), (6, 2, 16), (8, 2, 64), (16, 2, 80), (6, 2, 40)],
)
def test_extend_attention_is_causal_over_each_sequences_cached_prefix(
    dtype, H, KVH, Dh, monkeypatch
):
    """Chunks of queries after cached prefixes (and a decode row, and a whole fresh prompt) in
    one call, against a float64 causal softmax per sequence."""
    from baton.kernels.attention import build_attention_layout, paged_attention

    g = torch.Generator().manual_seed(12)
    slots = 400
    k_cache = torch.randn(slots, KVH, Dh, generator=g).to(dtype)
    v_cache = torch.randn(slots, KVH, Dh, generator=g).to(dtype)
    q_lens, kv_lens = [5, 1, 37, 3], [12, 20, 37, 3]  # prefix 7; decode; fresh prompt; fresh
    kv_indices = torch.zeros(4, 48, dtype=torch.int64)
    for s, n in enumerate(kv_lens):
        kv_indices[s, :n] = torch.randperm(slots - 1, generator=g)[:n] + 1
    layout = build_attention_layout(q_lens, kv_lens, kv_indices, "cpu")
    q = torch.randn(sum(q_lens), H, Dh, generator=g).to(dtype)
    calls = []
    fused = cpu_ops.extend_attention_cpu
    monkeypatch.setattr(cpu_ops, "extend_attention_cpu", lambda *a: calls.append(1) or fused(*a))
    out = paged_attention(q, k_cache, v_cache, layout, 0.3)
    assert calls == [1]
    ref, row = [], 0
    for s, (n_q, n_kv) in enumerate(zip(q_lens, kv_lens)):
        k = k_cache[kv_indices[s, :n_kv]].double().repeat_interleave(H // KVH, dim=1)
        v = v_cache[kv_indices[s, :n_kv]].double().repeat_interleave(H // KVH, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", q[row : row + n_q].double(), k) * 0.3
        position = n_kv - n_q + torch.arange(n_q)
        scores.masked_fill_(torch.arange(n_kv)[None, None, :] > position[None, :, None], -math.inf)
        ref.append(torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v))
        row += n_q
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), torch.cat(ref).float(), atol=tol, rtol=tol)
    bad = kv_indices.clone()
    bad[2, 30] = -1
    with pytest.raises(IndexError, match="sequence 2 has a token slot outside the cache"):
        cpu_ops.extend_attention_cpu(
            q, k_cache, v_cache, bad, layout.kv_lens, layout.query_start_loc, 0.3
        )
    too_many = layout.query_start_loc.clone()
    too_many[1:] += 10  # sequence 0 would hold 15 queries in 12 tokens
    with pytest.raises(ValueError, match="query offsets"):
        cpu_ops.extend_attention_cpu(q, k_cache, v_cache, kv_indices, layout.kv_lens, too_many, 0.3)


@needs_cc
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_over_random_shapes_matches_a_float64_softmax(seed):
    """Shapes the fixed cases above do not name: head sizes 8..256 (multiples of 16 and not),
    1..16 heads per KV head, mixed decode rows, chunks after cached prefixes and fresh
    prompts, float32 and bfloat16 caches; each batch through the CPU path the engine runs."""
    from baton.kernels.attention import build_attention_layout, paged_attention

    g = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    for _ in range(15):
        dtype = pick([torch.float32, torch.bfloat16])
        kvh, group = pick([1, 2, 3, 4]), pick([1, 2, 3, 5, 6, 7, 8, 12, 16])
        dh = pick([8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 256])
        seqs = int(torch.randint(1, 6, (1,), generator=g))
        kv_lens = torch.randint(1, 70, (seqs,), generator=g).tolist()
        decode = bool(torch.randint(2, (1,), generator=g))
        q_lens = [1 if decode else int(torch.randint(1, n + 1, (1,), generator=g)) for n in kv_lens]
        slots = sum(kv_lens) + 8
        k_cache = torch.randn(slots, kvh, dh, generator=g).to(dtype)
        v_cache = torch.randn(slots, kvh, dh, generator=g).to(dtype)
        kv_indices = torch.zeros(seqs, max(kv_lens) + 3, dtype=torch.int64)
        for s, n in enumerate(kv_lens):
            kv_indices[s, :n] = torch.randperm(slots, generator=g)[:n]
        layout = build_attention_layout(q_lens, kv_lens, kv_indices, "cpu")
        q = torch.randn(sum(q_lens), kvh * group, dh, generator=g).to(dtype)
        scale = dh**-0.5
        out = paged_attention(q, k_cache, v_cache, layout, scale)
        ref, row = [], 0
        for s, (n_q, n_kv) in enumerate(zip(q_lens, kv_lens)):
            k = k_cache[kv_indices[s, :n_kv]].double().repeat_interleave(group, dim=1)
            v = v_cache[kv_indices[s, :n_kv]].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,nhd->hqn", q[row : row + n_q].double(), k) * scale
            position = n_kv - n_q + torch.arange(n_q)
            future = torch.arange(n_kv)[None, None, :] > position[None, :, None]
            ref.append(
                torch.einsum("hqn,nhd->qhd", scores.masked_fill(future, -math.inf).softmax(-1), v)
            )
            row += n_q
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        shape = f"{dtype} kvh {kvh} x {group} dh {dh} q {q_lens} kv {kv_lens}"
        assert out.shape == q.shape and out.dtype == dtype, shape
        torch.testing.assert_close(
            out.float(),
            torch.cat(ref).float(),
            atol=tol,
            rtol=tol,
            msg=lambda m, shape=shape: f"{shape}: {m}",
        )


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_multiplier", [1.0, 0.35])
def test_silu_mul_rounds_like_the_torch_expression(dtype, gate_multiplier):
    """SwiGLU's elementwise part in one pass equals up * silu(gate * m) in torch, op by op
    (bf16: all but a rare last-bit difference from the exp), on strided rows."""
    from baton.engine.layers.mlp import gated_activation

    g = torch.Generator().manual_seed(5)
    wide = (3 * torch.randn(37, 2 * 150 + 9, generator=g)).to(dtype)
    gate_up = wide[:, : 2 * 150]  # rows wider than the [gate | up] they hold
    assert cpu_ops.silu_mul_supported(gate_up)
    out = gated_activation(gate_up, "silu", gate_multiplier)
    gate, up = gate_up.chunk(2, dim=-1)
    want = up * F.silu(gate * gate_multiplier if gate_multiplier != 1.0 else gate)
    assert out.shape == want.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
        assert (out == want).float().mean() > 0.99
