"""The matmul dtype chosen at load (kernels/linear.py MatmulChooser): the choice is a function of
the timings, forced policies are honoured without timing, and both forms of a bf16/fp16 linear
match a float64 reference within the dtype's rounding, alone and in a whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton import LLM, SamplingParams
from baton.kernels.linear import (
    MATMUL_DTYPE_ENV,
    TIMING_ROUNDS,
    MatmulChooser,
    PackedLinear,
    can_pack,
    matmul_dtypes,
    matmul_policy,
    pack_linears,
)
from tests.reference import hf_prompt_logprobs

pytestmark = pytest.mark.skipif(
    not can_pack(torch.float32), reason="oneDNN is not available: nothing is packed"
)
needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16), reason="no oneDNN bf16 here")


class FakeTimer:
    """Seconds per (in, out, form) from a table; counts the calls."""

    def __init__(self, table: dict[tuple[int, int, str], float]):
        self.table, self.calls = table, []

    def __call__(self, in_features: int, out_features: int, form: str) -> float:
        self.calls.append((in_features, out_features, form))
        return self.table[(in_features, out_features, form)]


def test_a_burst_of_load_during_one_timing_does_not_decide_the_dtype():
    """The first model-dtype timing is 5x slow (another process took the core): the alternated
    rounds still see bf16 twice as fast and keep it."""
    seconds = iter([5.0, 2.0, 1.0, 2.0, 1.0, 2.0])  # model, float32, model, float32, ...
    chooser = MatmulChooser(torch.bfloat16, "auto", lambda i, o, form: next(seconds))
    assert chooser(64, 256) == torch.bfloat16
    assert chooser.timings[(64, 256)] == (1.0, 2.0)


def test_choice_is_a_function_of_the_timings():
    table = {
        (64, 256, "model"): 2.0,
        (64, 256, "float32"): 1.0,  # fp32 twice as fast: float32
        (256, 64, "model"): 1.0,
        (256, 64, "float32"): 2.0,  # model dtype faster: bfloat16
        (32, 32, "model"): 1.0,
        (32, 32, "float32"): 0.95,  # within the margin: the model dtype (no casts added)
    }
    choices = []
    for _ in range(2):  # the same table gives the same choices
        timer = FakeTimer(table)
        chooser = MatmulChooser(torch.bfloat16, policy="auto", timer=timer)
        picked = [chooser(64, 256), chooser(256, 64), chooser(32, 32), chooser(64, 256)]
        assert picked == [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
        # each shape timed in alternated rounds of both forms, then cached
        assert len(timer.calls) == 6 * TIMING_ROUNDS
        assert timer.calls[:4] == [(64, 256, f) for f in ("model", "float32")] * 2
        choices.append(picked)
    assert choices[0] == choices[1]
    assert "64x256: float32" in chooser.summary()


def test_forced_policies_and_float32_models_never_time():
    def boom(*_):
        raise AssertionError("timed under a forced policy")

    assert MatmulChooser(torch.bfloat16, "float32", boom)(64, 64) == torch.float32
    assert MatmulChooser(torch.bfloat16, "model", boom)(64, 64) == torch.bfloat16
    assert MatmulChooser(torch.float16, "model", boom)(64, 64) == torch.float16
    assert MatmulChooser(torch.float32, "auto", boom)(64, 64) == torch.float32


def test_policy_comes_from_the_environment_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv(MATMUL_DTYPE_ENV, raising=False)
    assert matmul_policy() == "auto"
    monkeypatch.setenv(MATMUL_DTYPE_ENV, "Float32")
    assert matmul_policy() == "float32"
    assert MatmulChooser(torch.bfloat16).policy == "float32"
    monkeypatch.setenv(MATMUL_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=f"{MATMUL_DTYPE_ENV}='fp8'.*auto, model, float32"):
        MatmulChooser(torch.bfloat16)


def _linear(dtype, bias, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(48, 80, bias=bias)
    if bias:
        nn.init.normal_(linear.bias)
    return linear.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_both_forms_match_the_reference(dtype, bias, activation):
    linear = _linear(dtype, bias)
    x = torch.randn(7, 48).to(dtype)
    ref = x.double() @ linear.weight.double().T
    if bias:
        ref = ref + linear.bias.double()
    if activation == "relu":
        ref = ref.relu()
    forms = [torch.float32] + ([dtype] if can_pack(dtype) else [])
    for compute in forms:
        packed = PackedLinear(linear, activation, compute_dtype=compute)
        assert packed.compute_dtype == compute and packed.upcast == (compute != dtype)
        out = packed(x)
        assert out.dtype == dtype  # results in the model dtype whatever the matmul ran in
        # float32 accumulation either way: only the final rounding to `dtype` differs
        tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max(), rtol=tol)


def test_chooser_reaches_layers_that_pack_themselves_and_fp16_models():
    """PackedLinears built inside `matmul_dtypes` (as attention / MLP `pack_for_cpu` build
    theirs) and `pack_linears` take the chooser's dtype; an fp16 model, which oneDNN cannot
    pack, gets packed float32 linears where float32 is chosen and keeps nn.Linear elsewhere."""
    table = {(48, 80, "model"): 1.0, (48, 80, "float32"): 0.5}
    table |= {(80, 48, "model"): 0.5, (80, 48, "float32"): 1.0}
    model = nn.Sequential(_linear(torch.float16, True), nn.ReLU(), nn.Linear(80, 48).half())
    with matmul_dtypes(MatmulChooser(torch.float16, "auto", FakeTimer(table))):
        assert pack_linears(model, torch.float16) == 1
    assert isinstance(model[0], PackedLinear) and model[0].compute_dtype == torch.float32
    assert type(model[2]) is nn.Linear  # fp16 chosen: oneDNN cannot pack it, F.linear stays
    assert model(torch.randn(3, 48).half()).dtype == torch.float16
    if can_pack(torch.bfloat16):
        linear = _linear(torch.bfloat16, False)
        timer = FakeTimer({(48, 80, "model"): 2.0, (48, 80, "float32"): 1.0})
        with matmul_dtypes(MatmulChooser(torch.bfloat16, "auto", timer)):
            assert PackedLinear(linear).compute_dtype == torch.float32
        assert PackedLinear(linear).compute_dtype == torch.bfloat16  # outside: the weight's


@needs_bf16
@pytest.mark.parametrize("policy", ["model", "float32"])
def test_forced_policy_is_honoured_in_a_whole_model(tiny_models, monkeypatch, policy):
    """A bf16 model loaded under each forced policy packs every matmul in that dtype and its
    prompt logprobs match transformers' (float32) within bf16 rounding."""
    model_dir, hf = tiny_models("base")
    monkeypatch.setenv(MATMUL_DTYPE_ENV, policy)
    llm = LLM(model_dir, dtype="bfloat16", page_size=4)
    packed = [m for m in llm.engine.model.modules() if isinstance(m, PackedLinear)]
    expected = torch.float32 if policy == "float32" else torch.bfloat16
    assert packed and all(m.compute_dtype == expected for m in packed)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, hf.config.vocab_size, (40,), generator=g).tolist()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    ref = hf_prompt_logprobs(hf, prompt)
    got = torch.tensor([next(iter(e.values())) for e in out.prompt_logprobs[1:]])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max() < 0.05, (got - want).abs().max()  # measured ~0.013
