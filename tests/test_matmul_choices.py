"""The matmul chooser's timed choices are kept per machine (kernels/matmul_choices.py): a later
engine start on the same machine times nothing; another machine key, or a file that cannot be
read, is timed again."""

from __future__ import annotations

import json

import pytest
import torch

import kernels.linear
from engine.checkpoint.loader import load_model
from kernels import cpu_gemm
from kernels.linear import MatmulChooser, can_pack
from kernels.matmul_choices import ChoiceCache, machine_key

needs_fp32_pack = pytest.mark.skipif(not can_pack(torch.float32), reason="no oneDNN fp32 packing")


def _never(*args) -> float:
    raise AssertionError(f"timed {args} although the choice was kept")


def _fp32_faster(in_features: int, out_features: int, form: str) -> float:
    return 0.5 if form == "float32" else 1.0


@needs_fp32_pack
def test_a_later_start_takes_the_kept_dtype_choice_and_times_nothing(tmp_path):
    path = tmp_path / "choices.json"
    first = MatmulChooser(torch.bfloat16, "auto", _fp32_faster, cache=ChoiceCache(path))
    assert first(64, 96) == torch.float32
    later = MatmulChooser(torch.bfloat16, "auto", _never, cache=ChoiceCache(path))
    assert later(64, 96) == torch.float32
    assert later.timings[(64, 96)] == first.timings[(64, 96)]  # the summary still shows them
    assert later.num_cached == 1


@pytest.mark.skipif(not cpu_gemm.supports(torch.float32), reason="baton's GEMM does not run here")
def test_a_later_start_takes_the_kept_gemm_choice_and_times_nothing(tmp_path):
    path = tmp_path / "choices.json"

    def onednn_faster(in_features, out_features, dtype, kernel):
        return 1.0 if kernel == "onednn" else 2.0

    first = MatmulChooser(
        torch.float32, gemm="auto", gemm_timer=onednn_faster, cache=ChoiceCache(path)
    )
    assert first.kernel(64, 96, torch.float32) == "onednn"
    later = MatmulChooser(torch.float32, gemm="auto", gemm_timer=_never, cache=ChoiceCache(path))
    assert later.kernel(64, 96, torch.float32) == "onednn"


@needs_fp32_pack
def test_without_a_cache_every_chooser_times_again(tmp_path):
    calls = []

    def counting(in_features, out_features, form):
        calls.append(form)
        return _fp32_faster(in_features, out_features, form)

    for _ in range(2):
        MatmulChooser(torch.bfloat16, "auto", counting)(64, 96)
    assert len(calls) == 2 * 2 * kernels.linear.TIMING_ROUNDS


def test_the_key_changes_with_threads_and_timing_rules():
    assert machine_key(1, "rules") != machine_key(2, "rules")
    assert machine_key(2, "rules") != machine_key(2, "other rules")
    assert machine_key(2, "rules") == machine_key(2, "rules")


@needs_fp32_pack
def test_an_unreadable_file_is_timed_again_and_rewritten(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    chooser = MatmulChooser(torch.bfloat16, "auto", _fp32_faster, cache=ChoiceCache(path))
    assert chooser(64, 96) == torch.float32 and chooser.num_cached == 0
    assert json.loads(path.read_text())["dtype bfloat16 64x96"][0] == "float32"


def test_a_kept_choice_that_is_not_a_choice_is_ignored(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"dtype bfloat16 64x96": ["int8", 1.0, 1.0]}))
    calls = []
    chooser = MatmulChooser(
        torch.bfloat16, "auto", lambda *a: calls.append(a) or 1.0, cache=ChoiceCache(path)
    )
    chooser(64, 96)
    assert calls or not can_pack(torch.float32)  # timed (no fp32 packing: nothing to choose)
    assert chooser.num_cached == 0


def test_two_writers_keep_each_others_choices(tmp_path):
    """`baton up` starts two engines that time at the same moment."""
    path = tmp_path / "choices.json"
    prefill, decode = ChoiceCache(path), ChoiceCache(path)  # both read the empty file
    prefill.put("gemm float32 8x8", ("baton", 1.0, 0.5))
    decode.put("gemm float32 16x16", ("onednn", 0.5, 1.0))
    assert set(ChoiceCache(path).entries) == {"gemm float32 8x8", "gemm float32 16x16"}


def test_loading_a_model_twice_times_its_shapes_once(tiny_models, tmp_path, monkeypatch):
    """The CPU backend keeps its choices in $BATON_CACHE_DIR: the second engine start of a
    model on this machine runs no timing."""
    model_dir, _ = tiny_models("base")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    timed = []

    def counting_gemm(in_features, out_features, dtype, kernel):
        timed.append((in_features, out_features))
        return 1.0 if kernel == "baton" else 2.0

    monkeypatch.setattr(kernels.linear, "time_gemm", counting_gemm)
    load_model(model_dir, torch.float32, "cpu")
    if not timed:
        pytest.skip("this CPU runs no GEMM choice for float32 (baton's GEMM unsupported)")
    first = len(timed)
    load_model(model_dir, torch.float32, "cpu")
    assert len(timed) == first
    assert list(tmp_path.glob("matmul-choices-*.json"))
