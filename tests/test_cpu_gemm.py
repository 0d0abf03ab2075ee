"""baton's CPU GEMM (kernels/cpu/gemm.c) and how the linears choose it (kernels/linear.py):
the kernel against a float64 reference over the shapes its blocking splits (row blocks of
8/4/2/1, tiles of 1-3 column blocks, a ragged last block, odd K, strided rows), the packed
layout against a naive oracle, the choice as a function of timings, and whole models on it
against transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton import LLM, SamplingParams
from baton.kernels.cpu import gemm as cpu_gemm
from baton.kernels.linear import (
    GEMM_ENV,
    TIMING_ROUNDS,
    MatmulChooser,
    PackedLinear,
    can_pack,
    gemm_policy,
)
from tests.reference import assert_greedy_matches, hf_greedy, hf_prompt_logprobs

DTYPES = [
    pytest.param(
        dtype,
        marks=pytest.mark.skipif(not cpu_gemm.supports(dtype), reason=f"no {dtype} GEMM here"),
    )
    for dtype in (torch.float32, torch.bfloat16)
]
HAS_AMX = cpu_gemm.supports(torch.bfloat16) and cpu_gemm.amx_from_rows(cpu_gemm.AMX_MIN_ROWS)
# bf16's two paths: the register kernels and AMX (tile multiply-adds), each forced at every row
# count where this machine has it
PATHS = [
    "registers",
    pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX here")),
]


@pytest.fixture
def gemm_path(request):
    """Run bfloat16 on one path (the param) for the test, the default rows after."""
    cpu_gemm.amx_from_rows(1 if request.param == "amx" else 0)
    yield request.param
    cpu_gemm.amx_from_rows(cpu_gemm.AMX_MIN_ROWS)


needs_onednn = pytest.mark.skipif(not can_pack(torch.float32), reason="oneDNN is not available")


def _tolerance(dtype: torch.dtype) -> float:
    """float32 accumulation either way; a bf16 result carries its own rounding (2^-8)."""
    return 1e-5 if dtype == torch.float32 else 8e-3


def _reference(x, w, bias, relu):
    ref = x.double() @ w.double().T
    if bias is not None:
        ref = ref + bias.double()
    return ref.relu() if relu else ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 8, 16),  # one row, one block
        (7, 33, 50),  # rows 4+2+1, odd K, a ragged 4th block in a 1-block tile
        (15, 64, 32),  # rows 8+4+2+1, one 2-block tile
        (32, 130, 100),  # decode-like rows, a 3-block tile then a ragged one
        (70, 96, 200),  # rows past 64, several tiles per thread
        (3, 1, 5),  # K = 1: only the odd tail
        # AMX: a row tile and a partial one, 33 k pairs (a partial last run of 16), 3 blocks
        (17, 65, 48),
        # AMX: a pair of row tiles then a partial one, 16 k pairs exactly, one ragged block
        (33, 32, 9),
        # AMX: two row panels (128 + 22 rows: a pair and a single tile), 19 runs of 16 k pairs
        (150, 600, 40),
        # rows in chunks of L2's size (cpu/gemm.c row_chunk): fp32 32 + 32 + 11, bf16 56 + 19
        (75, 4200, 40),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("gemm_path", PATHS, indirect=True)
def test_gemm_matches_float64(dtype, m, k, n, bias, relu, gemm_path):
    if gemm_path == "amx" and dtype != torch.bfloat16:
        pytest.skip("AMX runs bfloat16 only")
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = cpu_gemm.linear(x, cpu_gemm.pack(w), n, b, relu)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = _reference(x, w, b, relu)
    tol = _tolerance(dtype)
    torch.testing.assert_close(y.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemm_path", PATHS, indirect=True)
def test_strided_rows_and_odd_k_never_read_past_a_row(dtype, gemm_path):
    if gemm_path == "amx" and dtype != torch.bfloat16:
        pytest.skip("AMX runs bfloat16 only")
    """x is a view whose rows are followed by NaN: the kernel reads the row stride it is given,
    and an odd K's last pair (bf16) does not touch the element after the row."""
    m, k, n = 9, 37, 40
    g = torch.Generator().manual_seed(1)
    wide = torch.full((m, k + 3), float("nan")).to(dtype)
    wide[:, :k] = torch.randn(m, k, generator=g).to(dtype)
    x = wide[:, :k]
    w = torch.randn(n, k, generator=g).to(dtype)
    y = cpu_gemm.linear(x, cpu_gemm.pack(w), n)
    assert not y.isnan().any()
    ref = _reference(x, w, None, False)
    tol = _tolerance(dtype)
    torch.testing.assert_close(y.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    # leading dimensions are kept: (2, 3, k) in, (2, 3, n) out
    x3 = x[:6].reshape(2, 3, k)
    assert torch.equal(cpu_gemm.linear(x3, cpu_gemm.pack(w), n).reshape(6, n), y[:6])


def test_packed_layout_matches_a_naive_oracle():
    n, k = 20, 5
    w = torch.arange(n * k, dtype=torch.float32).view(n, k) + 1
    blocks = -(-n // 16)
    for dtype, pair in ((torch.float32, 1), (torch.bfloat16, 2)):
        kp = -(-k // pair) * pair
        want = torch.zeros(blocks * 16 * kp, dtype=dtype)
        for b in range(blocks):
            for p in range(kp // pair):
                for c in range(16):
                    for h in range(pair):
                        row, col = b * 16 + c, p * pair + h
                        if row < n and col < k:
                            index = ((b * (kp // pair) + p) * 16 + c) * pair + h
                            want[index] = w[row, col]
        assert torch.equal(cpu_gemm.pack(w.to(dtype)), want)


@pytest.mark.skipif(cpu_gemm.library() is None, reason="no compiler or BATON_CPU_OPS=0")
def test_bad_arguments_are_named():
    w = cpu_gemm.pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match=r"not \(48, 16\)"):
        cpu_gemm.linear(torch.randn(4, 16), w, 48)
    with pytest.raises(ValueError, match="x torch.bfloat16 with weights packed in torch.float32"):
        cpu_gemm.linear(torch.randn(4, 16).bfloat16(), w, 32)
    with pytest.raises(ValueError, match="float32 vector"):
        cpu_gemm.linear(torch.randn(4, 16), w, 32, torch.randn(32).double())
    with pytest.raises(ValueError, match="packs 2-D float32/bfloat16"):
        cpu_gemm.pack(torch.randn(4, 4).half())
    assert cpu_gemm.linear(torch.randn(0, 16), w, 32).shape == (0, 32)


@needs_onednn
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_packed_linear_on_either_gemm_agrees(dtype, activation):
    """The same PackedLinear on oneDNN and on baton's GEMM: both within rounding of float64, and
    a bf16 model's linear computing in float32 (upcast) on baton's fp32 GEMM too."""
    if not can_pack(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    torch.manual_seed(0)
    linear = nn.Linear(72, 56, bias=True).to(dtype).requires_grad_(False)
    x = torch.randn(5, 72).to(dtype)
    ref = _reference(x, linear.weight, linear.bias, activation == "relu")
    computes = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
    tol = _tolerance(dtype)
    for compute in computes:
        for kernel in ("onednn", "baton"):
            if kernel == "baton" and not cpu_gemm.supports(compute):
                continue
            layer = PackedLinear(linear, activation, compute_dtype=compute, kernel=kernel)
            assert layer.kernel == kernel and f"for {kernel}" in repr(layer)
            out = layer(x)
            assert out.dtype == dtype
            torch.testing.assert_close(
                out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol
            )
    with pytest.raises(ValueError, match="unknown GEMM 'mkl'"):
        PackedLinear(linear, kernel="mkl")


class FakeGemmTimer:
    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, in_features, out_features, dtype, kernel):
        self.calls.append((in_features, out_features, dtype, kernel))
        return self.table[(in_features, out_features, kernel)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_choice_is_a_function_of_the_timings(dtype):
    table = {(64, 256, "onednn"): 2.0, (64, 256, "baton"): 1.0}
    table |= {(256, 64, "onednn"): 1.0, (256, 64, "baton"): 1.5}
    # within the margin (hot timings understate the prefetch's gain on cold weights): baton
    table |= {(32, 32, "onednn"): 1.0, (32, 32, "baton"): 1.1}
    table |= {(48, 48, "onednn"): 1.0, (48, 48, "baton"): 1.4}
    timer = FakeGemmTimer(table)
    chooser = MatmulChooser(dtype, "model", gemm="auto", gemm_timer=timer, amx=False)
    picked = [chooser.kernel(64, 256, dtype), chooser.kernel(256, 64, dtype)]
    assert picked + [chooser.kernel(32, 32, dtype)] == ["baton", "onednn", "baton"]
    assert chooser.kernel(48, 48, dtype) == "onednn"
    # where baton's bf16 runs on AMX (decode's rows faster than any hot timing shows), 1.4x
    # slower at the timed rows keeps baton, 1.5x does not; float32 keeps its margin
    amx = MatmulChooser(dtype, "model", gemm="auto", gemm_timer=timer, amx=True)
    bf16 = dtype == torch.bfloat16
    assert [amx.kernel(48, 48, dtype), amx.kernel(256, 64, dtype)] == [
        "baton" if bf16 else "onednn",
        "onednn",
    ]
    assert chooser.kernel(64, 256, dtype) == "baton"  # cached: timed once per shape and dtype
    assert len(timer.calls) == 6 * 2 * TIMING_ROUNDS
    assert [c[3] for c in timer.calls[:4]] == ["onednn", "baton"] * 2  # alternated rounds
    assert "64x256" in chooser.summary() and "baton" in chooser.summary()


def test_forced_gemm_never_times_and_bad_values_are_named(monkeypatch):
    def boom(*_):
        raise AssertionError("timed under a forced GEMM")

    for dtype in (torch.float32, torch.bfloat16):
        chooser = MatmulChooser(dtype, "model", gemm="onednn", gemm_timer=boom)
        assert chooser.kernel(64, 64, dtype) == "onednn"
        forced = MatmulChooser(dtype, "model", gemm="baton", gemm_timer=boom).kernel(64, 64, dtype)
        assert forced == ("baton" if cpu_gemm.supports(dtype) else "onednn")
    # a dtype the kernel does not take is never timed either
    assert MatmulChooser(torch.float16, "model", gemm_timer=boom).kernel(8, 8, torch.float16) == (
        "onednn"
    )
    monkeypatch.setenv(GEMM_ENV, "Baton")
    assert gemm_policy() == "baton"
    monkeypatch.setenv(GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match=f"{GEMM_ENV}='mkl'.*auto, onednn, baton"):
        MatmulChooser(torch.float32)


@needs_onednn
@pytest.mark.skipif(not cpu_gemm.supports(torch.float32), reason="no float32 GEMM here")
def test_a_whole_model_on_baton_gemm_matches_transformers(tiny_models, monkeypatch):
    """Every matmul of a float32 model forced onto baton's GEMM: greedy tokens equal to
    transformers' and prompt logprobs within float32 rounding."""
    model_dir, hf = tiny_models("base")
    monkeypatch.setenv(GEMM_ENV, "baton")
    llm = LLM(model_dir, dtype="float32", page_size=4)
    packed = [m for m in llm.engine.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.kernel == "baton" for m in packed)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (9, 23)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf, prompt, 12)
        assert assert_greedy_matches(out.token_ids, tokens, logprobs, "baton GEMM") == 12
        ref = hf_prompt_logprobs(hf, prompt)
        got = torch.tensor([next(iter(e.values())) for e in out.prompt_logprobs[1:]])
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert (got - want).abs().max() < 1e-3
