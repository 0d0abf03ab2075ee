"""The batched LoRA kernels (kernels/lora.py: shrink + expand, each row its own slot's adapter):
the C kernels (kernels/cpu/lora.c), the torch path and the Triton kernels (interpreter, tiny
shapes) against a float64 oracle that loops over rows; rows without an adapter left untouched;
a fused projection's parts shrunk at once and expanded into their column ranges; a bad slot
refused naming its row; the C ops recorded in a captured CPU step refilled on replay."""

from __future__ import annotations

import pytest
import torch

import baton.kernels.triton.lora as triton_lora
from baton.engine.executor.cpu_plan import Recorder, new_plan, plans_available
from baton.kernels import lora
from baton.kernels.cpu import lora as cpu_lora

SLOTS, RANK, IN, OUT = 3, 4, 24, 40
ROW_SLOTS = [2, -1, 0, 2, 1, -1, 0]  # a mix: repeated slots, rows without an adapter
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
needs_c = pytest.mark.skipif(cpu_lora.library() is None, reason="the C extension is not built")


# a prefill's rows: runs of one slot (sequences), boundaries inside 16-row blocks, a block of -1
SEGMENTS = [1] * 21 + [-1] * 19 + [0] * 5 + [2] * 30 + [1] * 3


def table(dtype, parts=1, seed=0, out=OUT, row_slots=ROW_SLOTS):
    gen = torch.Generator().manual_seed(seed)
    a_rows = torch.randn(parts * SLOTS * RANK, IN, generator=gen).to(dtype)
    b_rows = [torch.randn(SLOTS * RANK, out, generator=gen).to(dtype) for _ in range(parts)]
    x = torch.randn(len(row_slots), IN, generator=gen).to(dtype)
    y = torch.randn(len(row_slots), out * parts, generator=gen).to(dtype)
    return x, a_rows, b_rows, torch.tensor(row_slots), y


def oracle(x, a_rows, b_rows, lora_slots, y):
    """float64, row by row: each part's x @ A_s.T @ B_s added to its columns of y."""
    want = y.double().clone()
    parts = len(b_rows)
    for t, s in enumerate(lora_slots.tolist()):
        if s < 0:
            continue
        for p, b in enumerate(b_rows):
            a = a_rows.double()[(p * SLOTS + s) * RANK : (p * SLOTS + s + 1) * RANK]
            cols = slice(p * b.shape[1], (p + 1) * b.shape[1])
            want[t, cols] += x[t].double() @ a.T @ b.double()[s * RANK : (s + 1) * RANK]
    assert parts >= 1
    return want


def fused(x, a_rows, b_rows, lora_slots, y):
    """The FusedLoRALinear pattern: one shrink over every part, each expand into its columns."""
    low = lora.lora_shrink(x, a_rows, lora_slots, RANK, len(b_rows))
    n = b_rows[0].shape[1]
    for p, b in enumerate(b_rows):
        lora.lora_expand(low[:, p * RANK :], b, lora_slots, RANK, y[:, p * n : (p + 1) * n])
    return y


@pytest.fixture
def backend(monkeypatch):
    """backend(name): run the kernels under BATON_KERNELS=name; `calls` records the Triton
    launchers and C wrappers that ran, so each test proves which path it measured."""
    calls: list[str] = []
    for module, suffix in ((triton_lora, "_triton"), (cpu_lora, "_cpu")):
        for name in [n for n in dir(module) if n.startswith("lora_") and n.endswith(suffix)]:
            launcher = getattr(module, name)

            def spy(*args, _launcher=launcher, _name=name, **kwargs):
                calls.append(_name)
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)

    library = cpu_lora.library

    def select(name: str, c_ops: bool = True):
        monkeypatch.setenv("BATON_KERNELS", name)
        monkeypatch.setattr(cpu_lora, "library", library if c_ops else lambda: None)
        return calls

    return select


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 3])
def test_c_kernels_match_the_oracle(backend, dtype, parts):
    calls = backend("torch")
    x, a_rows, b_rows, lora_slots, y = table(dtype, parts)
    want = oracle(x, a_rows, b_rows, lora_slots, y)
    got = fused(x, a_rows, b_rows, lora_slots, y.clone())
    assert calls == ["lora_shrink_cpu"] + ["lora_expand_cpu"] * parts
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@needs_c
@pytest.mark.parametrize(
    ("activations", "table_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_c_kernels_take_activations_and_table_of_different_dtypes(
    backend, activations, table_dtype
):
    """A quantized base keeps the table in float32 while the model may run in bf16."""
    calls = backend("torch")
    x, a_rows, b_rows, lora_slots, y = table(table_dtype)
    x, y = x.to(activations), y.to(activations)
    want = oracle(x, a_rows, b_rows, lora_slots, y)
    got = lora.lora_delta(x, a_rows, b_rows[0], lora_slots, RANK, y.clone())
    assert calls == ["lora_shrink_cpu", "lora_expand_cpu"]
    torch.testing.assert_close(got.double(), want, **TOL[torch.bfloat16])


@needs_c
def test_c_expand_splits_wide_outputs_into_column_blocks(backend):
    backend("torch")
    x, a_rows, b_rows, lora_slots, y = table(torch.float32, out=600)  # 3 blocks of 256
    want = oracle(x, a_rows, b_rows, lora_slots, y)
    got = lora.lora_delta(x, a_rows, b_rows[0], lora_slots, RANK, y.clone())
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 3])
def test_torch_path_matches_the_oracle(backend, dtype, parts):
    calls = backend("torch", c_ops=False)
    x, a_rows, b_rows, lora_slots, y = table(dtype, parts)
    want = oracle(x, a_rows, b_rows, lora_slots, y)
    got = fused(x, a_rows, b_rows, lora_slots, y.clone())
    assert calls == []
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [1, 3])
def test_triton_kernels_match_the_oracle(backend, dtype, parts):
    calls = backend("triton")
    x, a_rows, b_rows, lora_slots, y = table(dtype, parts)
    want = oracle(x, a_rows, b_rows, lora_slots, y)
    got = fused(x, a_rows, b_rows, lora_slots, y.clone())
    assert calls == ["lora_shrink_triton"] + ["lora_expand_triton"] * parts
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [1, 3])
def test_triton_grouped_kernels_match_the_oracle_on_a_prefill(backend, dtype, parts):
    """From GROUPED_ROWS rows on, blocks of rows go through each slot they use with tl.dot."""
    assert len(SEGMENTS) >= triton_lora.GROUPED_ROWS
    calls = backend("triton")
    x, a_rows, b_rows, lora_slots, y = table(dtype, parts, row_slots=SEGMENTS)
    want = oracle(x, a_rows, b_rows, lora_slots, y)
    got = fused(x, a_rows, b_rows, lora_slots, y.clone())
    assert calls == ["lora_shrink_triton"] + ["lora_expand_triton"] * parts
    untouched = lora_slots < 0
    assert torch.equal(got[untouched], y[untouched])
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("name", ["torch", "triton", "cpu"])
def test_rows_without_an_adapter_are_left_bit_identical(backend, name):
    if name == "cpu" and cpu_lora.library() is None:
        pytest.skip("the C extension is not built")
    backend("triton" if name == "triton" else "torch", c_ops=name == "cpu")
    x, a_rows, b_rows, lora_slots, y = table(torch.float32)
    got = lora.lora_delta(x, a_rows, b_rows[0], lora_slots, RANK, y.clone())
    untouched = lora_slots < 0
    assert torch.equal(got[untouched], y[untouched])
    assert not torch.equal(got[~untouched], y[~untouched])


@needs_c
@pytest.mark.parametrize("bad", [SLOTS, -2])
def test_a_slot_outside_the_table_is_refused_naming_the_row(backend, bad):
    backend("torch")
    x, a_rows, b_rows, lora_slots, y = table(torch.float32)
    lora_slots[4] = bad
    before = y.clone()
    with pytest.raises(IndexError, match=f"slot index {bad} of row 4 .* 3 slots"):
        lora.lora_delta(x, a_rows, b_rows[0], lora_slots, RANK, y)
    assert torch.equal(y, before)  # checked before anything is written


@pytest.mark.skipif(not plans_available(), reason="the C++ extension is not built")
def test_a_replayed_capture_refills_from_new_inputs_and_slots(backend):
    """The recorded step reads x and lora_slots from their buffers on every replay: new
    activations and a new mix of adapters give the new deltas."""
    calls = backend("torch")
    x, a_rows, b_rows, lora_slots, y = table(torch.float32, parts=2)
    base = y.clone()

    def step():
        y.copy_(base)
        return fused(x, a_rows, b_rows, lora_slots, y)

    plan = new_plan()
    with torch.inference_mode(), Recorder(plan) as recorder:
        step()
    assert recorder.error is None and len(plan) > 0 and "lora_shrink_cpu" in calls
    gen = torch.Generator().manual_seed(7)
    for mix in ([0, 0, 1, -1, 2, 2, -1], [-1, 1, 1, 0, -1, 2, 0]):
        x.copy_(torch.randn(x.shape, generator=gen))
        lora_slots.copy_(torch.tensor(mix))
        y.fill_(float("nan"))  # stale outputs must not survive a replay
        plan.replay()
        torch.testing.assert_close(
            y.double(), oracle(x, a_rows, b_rows, lora_slots, base), **TOL[torch.float32]
        )


def adapted_layers(seed=0):
    """A LoRALinear (out 40) and a FusedLoRALinear of three parts (q|k|v widths 16, 8, 8), with
    random slot tables."""
    from baton.engine.lora.layer import FusedLoRALinear, LoRALinear

    gen = torch.Generator().manual_seed(seed)

    def adapted(n: int, name: str) -> LoRALinear:
        layer = LoRALinear(torch.nn.Linear(IN, n), SLOTS, RANK, name)
        layer.base.weight.data.copy_(torch.randn(n, IN, generator=gen))
        layer.a_rows.copy_(torch.randn(SLOTS * RANK, IN, generator=gen))
        layer.b_rows.copy_(torch.randn(SLOTS * RANK, n, generator=gen))
        return layer

    single = adapted(OUT, "single")
    parts = [adapted(n, f"part{i}") for i, n in enumerate((16, 8, 8))]
    base = torch.nn.Linear(IN, 32)
    base.weight.data.copy_(torch.cat([p.base.weight for p in parts]))
    base.bias.data.copy_(torch.cat([p.base.bias for p in parts]))
    return single, FusedLoRALinear(base, parts)


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_adapted_layers_on_the_kernels_equal_the_dense_selection(backend, name):
    """LoRALinear and FusedLoRALinear give the dense path's outputs (every slot computed, the
    row's selected) when the batched kernels run instead."""
    from baton.engine.lora.layer import slot_rows

    if name == "cpu" and cpu_lora.library() is None:
        pytest.skip("the C extension is not built")
    single, fused_layer = adapted_layers()
    x = torch.randn(len(ROW_SLOTS), IN, generator=torch.Generator().manual_seed(3))
    lora_slots = torch.tensor(ROW_SLOTS)
    slot_of_column = torch.arange(SLOTS).repeat_interleave(RANK)

    def forward():
        with torch.no_grad(), slot_rows(lora_slots, slot_of_column, True):
            return single(x), fused_layer(x)

    calls = backend("torch", c_ops=False)
    want = forward()
    assert calls == []  # the dense selection ran
    backend("triton" if name == "triton" else "torch", c_ops=True)
    got = forward()
    suffix = "_cpu" if name == "cpu" else "_triton"
    assert (
        calls
        == [f"lora_shrink{suffix}", f"lora_expand{suffix}", f"lora_shrink{suffix}"]
        + [f"lora_expand{suffix}"] * 3
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)
