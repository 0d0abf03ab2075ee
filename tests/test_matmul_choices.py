"""The matmul chooser's timings are kept per machine (kernels/matmul_choices.py): each start that
times keeps the best time of each form over the starts so far, and once TRUSTED_SESSIONS starts
have timed a shape, later starts on the same machine time nothing; another machine key, or a
file that cannot be read, is timed again."""

from __future__ import annotations

import json

import pytest
import torch

import baton.kernels.linear
from baton.engine.checkpoint.loader import load_model
from baton.kernels.cpu import gemm as cpu_gemm
from baton.kernels.linear import MatmulChooser, can_pack
from baton.kernels.matmul_choices import TRUSTED_SESSIONS, ChoiceCache, machine_key

needs_fp32_pack = pytest.mark.skipif(not can_pack(torch.float32), reason="no oneDNN fp32 packing")
needs_baton_gemm = pytest.mark.skipif(
    not cpu_gemm.supports(torch.float32), reason="baton's GEMM does not run here"
)


def _never(*args) -> float:
    raise AssertionError(f"timed {args} although the shape was settled")


def _times(model_s: float, fp32_s: float):
    return lambda in_features, out_features, form: fp32_s if form == "float32" else model_s


def _dtype_chooser(timer, path) -> MatmulChooser:
    return MatmulChooser(torch.bfloat16, "auto", timer, cache=ChoiceCache(path))


@needs_fp32_pack
def test_a_settled_shape_is_decided_without_timing(tmp_path):
    path = tmp_path / "choices.json"
    for _ in range(TRUSTED_SESSIONS):
        assert _dtype_chooser(_times(1.0, 0.5), path)(64, 96) == torch.float32
    later = _dtype_chooser(_never, path)
    assert later(64, 96) == torch.float32
    assert later.timings[(64, 96)] == (1.0, 0.5)  # the log line still shows them
    assert later.num_cached == 1


@needs_fp32_pack
def test_a_shape_timed_by_fewer_starts_is_timed_again(tmp_path):
    path = tmp_path / "choices.json"
    for _ in range(TRUSTED_SESSIONS - 1):
        _dtype_chooser(_times(1.0, 0.5), path)(64, 96)
    with pytest.raises(AssertionError, match="timed"):
        _dtype_chooser(_never, path)(64, 96)


@needs_fp32_pack
def test_a_start_timed_under_load_does_not_outvote_the_best_times(tmp_path):
    """Load slows a timing, never speeds it: the choice rests on each form's best time."""
    path = tmp_path / "choices.json"
    assert _dtype_chooser(_times(1.0, 0.5), path)(64, 96) == torch.float32
    # a burst of other work slowed the float32 form ten times in the second start
    loaded = _dtype_chooser(_times(1.0, 5.0), path)
    assert loaded(64, 96) == torch.float32 and loaded.timings[(64, 96)] == (1.0, 0.5)


@needs_baton_gemm
def test_a_settled_gemm_choice_is_taken_without_timing(tmp_path):
    path = tmp_path / "choices.json"

    def onednn_faster(in_features, out_features, dtype, kernel):
        return 1.0 if kernel == "onednn" else 2.0

    for _ in range(TRUSTED_SESSIONS):
        chooser = MatmulChooser(
            torch.float32, gemm="auto", gemm_timer=onednn_faster, cache=ChoiceCache(path)
        )
        assert chooser.kernel(64, 96, torch.float32) == "onednn"
    later = MatmulChooser(torch.float32, gemm="auto", gemm_timer=_never, cache=ChoiceCache(path))
    assert later.kernel(64, 96, torch.float32) == "onednn"


@needs_fp32_pack
def test_without_a_cache_every_chooser_times_again():
    calls = []

    def counting(in_features, out_features, form):
        calls.append(form)
        return 1.0

    for _ in range(TRUSTED_SESSIONS + 1):
        MatmulChooser(torch.bfloat16, "auto", counting)(64, 96)
    assert len(calls) == (TRUSTED_SESSIONS + 1) * 2 * baton.kernels.linear.TIMING_ROUNDS


def test_the_key_changes_with_threads_and_timing_rules():
    assert machine_key(1, "rules") != machine_key(2, "rules")
    assert machine_key(2, "rules") != machine_key(2, "other rules")
    assert machine_key(2, "rules") == machine_key(2, "rules")


@needs_fp32_pack
def test_an_unreadable_file_is_timed_again_and_rewritten(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    chooser = _dtype_chooser(_times(1.0, 0.5), path)
    assert chooser(64, 96) == torch.float32 and chooser.num_cached == 0
    assert json.loads(path.read_text())["dtype bfloat16 64x96"] == [1.0, 0.5, 1]


def test_two_writers_keep_each_others_timings(tmp_path):
    """`baton up` starts two engines that time at the same moment."""
    path = tmp_path / "choices.json"
    prefill, decode = ChoiceCache(path), ChoiceCache(path)  # both read the empty file
    prefill.record("gemm float32 8x8", 1.0, 0.5)
    decode.record("gemm float32 16x16", 0.5, 1.0)
    decode.record("gemm float32 8x8", 2.0, 0.25)  # the decode engine timed it too
    entries = ChoiceCache(path).entries
    assert entries == {"gemm float32 8x8": (1.0, 0.25, 2), "gemm float32 16x16": (0.5, 1.0, 1)}


def test_loading_a_model_again_times_nothing_once_settled(tiny_models, tmp_path, monkeypatch):
    """The CPU backend keeps its timings in $BATON_CACHE_DIR."""
    model_dir, _ = tiny_models("base")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    timed = []

    def counting_gemm(in_features, out_features, dtype, kernel):
        timed.append((in_features, out_features))
        return 1.0 if kernel == "baton" else 2.0

    monkeypatch.setattr(baton.kernels.linear, "time_gemm", counting_gemm)
    for _ in range(TRUSTED_SESSIONS):
        load_model(model_dir, torch.float32, "cpu")
    if not timed:
        pytest.skip("this CPU times no GEMM choice for float32 (baton's GEMM unsupported)")
    settled = len(timed)
    load_model(model_dir, torch.float32, "cpu")
    assert len(timed) == settled
    assert list(tmp_path.glob("matmul-choices-*.json"))


def _decode_times(gemm_s: float, plain_s: float):
    return lambda in_features, out_features, dtype, kernel, form: (
        plain_s if form == "plain" else gemm_s
    )


@needs_fp32_pack
@pytest.mark.parametrize("plain_s, keeps_plain", [(0.2, True), (0.95, False)])
def test_a_small_linear_runs_decode_rows_on_a_plain_copy_where_timed_faster(plain_s, keeps_plain):
    """Decode's rows (up to PLAIN_ROWS) run F.linear on a plain copy of a small weight when the
    chooser timed it faster than the GEMM by the margin; prefill's rows always run the GEMM; the
    answer is the linear's either way."""
    torch.manual_seed(0)
    chooser = MatmulChooser(
        torch.float32, gemm="onednn", decode_timer=_decode_times(1.0, plain_s), cache=None
    )
    linear = torch.nn.Linear(48, 80)
    with baton.kernels.linear.matmul_dtypes(chooser):
        packed = baton.kernels.linear.PackedLinear(linear, activation="relu")
    assert (packed.plain is not None) is keeps_plain
    calls = []
    original = torch.nn.functional.linear
    for rows in (1, baton.kernels.linear.PLAIN_ROWS, baton.kernels.linear.PLAIN_ROWS + 1):
        x = torch.randn(rows, 48)
        torch.nn.functional.linear = lambda *a, n=rows: (calls.append(n), original(*a))[1]
        try:
            got = packed(x)
        finally:
            torch.nn.functional.linear = original
        torch.testing.assert_close(got, torch.relu(linear(x)), atol=1e-5, rtol=1e-5)
    want = [1, baton.kernels.linear.PLAIN_ROWS] if keeps_plain else []
    assert calls == want


@needs_fp32_pack
def test_a_large_linear_is_never_timed_for_a_plain_copy():
    chooser = MatmulChooser(torch.float32, gemm="onednn", decode_timer=_never, cache=None)
    side = int(baton.kernels.linear.SMALL_WEIGHT**0.5) + 1
    assert not chooser.plain_for_decode(side, side, torch.float32, "onednn")
