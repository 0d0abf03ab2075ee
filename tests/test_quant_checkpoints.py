"""What a quantized checkpoint may and may not be: configs baton refuses (naming key and value),
--quantization against the checkpoint, layers left unquantized, KV and input scales read and not
applied, and hostile tensors (a scale of the wrong shape, NaN scales, a weight of the wrong
dtype, a tensor-parallel size that would split a scale block): a load error naming tensor and
key before anything is served."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.checkpoint.loader import load_model
from baton.engine.config_error import ConfigError
from baton.engine.parallel import TensorParallel
from baton.engine.quantization.modules import QuantizedLinear
from baton.engine.quantization.schemes import WeightError
from baton.kernels.linear import PackedLinear

IN_PROJ = "backbone.layers.0.mixer.in_proj"


def copy_of(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def load(model_dir: Path, quantization: str | None = None, tp: TensorParallel | None = None):
    args = (model_dir, torch.float32, "cpu") + ((tp,) if tp is not None else ())
    return load_model(*args, quantization=quantization)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q.update(quant_method="gptq"), r"quant_method 'gptq' is not supported"),
        (lambda q: q.update(quant_algo="MXFP8"), r"quant_algo 'MXFP8' is not supported"),
        (lambda q: q.update(group_size=32), r"group_size=32 is not supported"),
    ],
)
def test_unknown_method_or_algorithm_is_refused_naming_key_and_value(
    quantized_models, tmp_path, edit, message
):
    model_dir = copy_of(quantized_models("nemotron_dense", "modelopt_nvfp4")[0], tmp_path / "m")
    edit_config(model_dir, edit)
    with pytest.raises(ConfigError, match=message):
        load(model_dir)


def test_quantization_flag_must_match_the_checkpoint(quantized_models):
    nvfp4, dequantized = quantized_models("nemotron_dense", "modelopt_nvfp4")
    with pytest.raises(ConfigError, match=r"--quantization fp8 does not match .*modelopt_fp4"):
        load(nvfp4, "fp8")
    with pytest.raises(ConfigError, match=r"--quantization modelopt_fp4 needs a checkpoint"):
        load(dequantized, "modelopt_fp4")
    assert any(isinstance(m, QuantizedLinear) for m in load(nvfp4, "modelopt").modules())


def test_fp8_on_an_unquantized_checkpoint_quantizes_at_load(quantized_models):
    _, dequantized = quantized_models("nemotron_moe", "modelopt_fp8")
    model = load(dequantized, "fp8")
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) >= 10 and all(m.format == "fp8" for m in quantized)
    assert isinstance(model.lm_head, PackedLinear)  # as vLLM, the head stays unquantized


def test_a_layer_an_exclude_list_misses_stays_in_its_stored_dtype(quantized_models, caplog):
    quantized, _ = quantized_models("nemotron_moe", "modelopt_nvfp4")
    with caplog.at_level(logging.INFO, logger="baton.engine.quantization.transform"):
        model = load(quantized)
    assert not isinstance(model.model.layers[2].mixer.in_proj, QuantizedLinear)  # unlisted
    assert not isinstance(model.model.layers[0].mixer.out_proj, QuantizedLinear)  # excluded
    assert isinstance(model.model.layers[0].mixer.in_proj, QuantizedLinear)
    assert "model.layers.2.mixer.in_proj" in caplog.text and "stay so" in caplog.text
    assert "2 k_scale/v_scale tensors) read and unused" in caplog.text
    assert "input_scale tensors read and not applied" in caplog.text


def test_a_quantized_layer_the_config_excludes_is_refused(quantized_models, tmp_path):
    model_dir = copy_of(quantized_models("nemotron_dense", "modelopt_fp8")[0], tmp_path / "m")
    edit_config(model_dir, lambda q: q["ignore"].append(IN_PROJ))
    with pytest.raises(WeightError, match=rf"{IN_PROJ[9:]}.weight is stored quantized.*ignore"):
        load(model_dir)


def test_a_scale_of_the_wrong_shape_is_refused_naming_tensor_and_key(quantized_models, tmp_path):
    model_dir = copy_of(quantized_models("nemotron_moe", "fp8_block")[0], tmp_path / "m")
    edit_tensors(model_dir, lambda t: t.update({f"{IN_PROJ}.weight_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(
        WeightError,
        match=r"in_proj.weight_scale_inv' has shape \(1, 1\); .* weight_block_size .* \(2, 1\)",
    ):
        load(model_dir)


def test_nan_scales_are_refused_naming_tensor_and_key(quantized_models, tmp_path):
    model_dir = copy_of(quantized_models("nemotron_dense", "modelopt_nvfp4")[0], tmp_path / "m")
    edit_tensors(
        model_dir, lambda t: t.update({f"{IN_PROJ}.weight_scale_2": torch.tensor(float("nan"))})
    )
    with pytest.raises(WeightError, match=r"in_proj.weight_scale_2'.*finite.*quant_algo"):
        load(model_dir)


def test_a_weight_of_the_wrong_dtype_is_refused_naming_tensor_and_key(quantized_models, tmp_path):
    model_dir = copy_of(quantized_models("nemotron_dense", "modelopt_fp8")[0], tmp_path / "m")
    edit_tensors(
        model_dir,
        lambda t: t.update({f"{IN_PROJ}.weight": t[f"{IN_PROJ}.weight"].to(torch.bfloat16)}),
    )
    with pytest.raises(WeightError, match=r"in_proj.weight' has dtype BF16; .*quant_algo \(FP8\)"):
        load(model_dir)


def test_a_missing_scale_is_refused_naming_tensor(quantized_models, tmp_path):
    model_dir = copy_of(quantized_models("nemotron_dense", "modelopt_nvfp4")[0], tmp_path / "m")
    edit_tensors(model_dir, lambda t: t.pop(f"{IN_PROJ}.weight_scale_2"))
    with pytest.raises(WeightError, match=r"in_proj.weight_scale_2' is missing"):
        load(model_dir)


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ("fp8_block", r"in_proj.weight: tensor-parallel size 2 would split a 128x128 scale block"),
        ("modelopt_nvfp4", r"down_proj.weight: tensor-parallel size 2 would split a group of 16"),
    ],
)
def test_a_tensor_parallel_size_that_splits_a_scale_block_is_refused(
    quantized_models, fmt, message
):
    """NemotronH's in_proj rows split per z | x | B | C | dt segment (32-row pieces here), and
    the shared expert's 48 inputs in 24 per rank: both would cut what one scale covers."""
    quantized, _ = quantized_models("nemotron_moe", fmt)
    rank = TensorParallel(rank=1, size=2, group=None, timeout_s=0.0)
    with pytest.raises(ConfigError, match=message):
        load(quantized, tp=rank)


def test_quantization_flag_reaches_the_engine(tmp_path, monkeypatch):
    from baton.server.cli import main

    (tmp_path / "config.json").write_text("{}")
    started = []
    monkeypatch.setattr("baton.server.launch.run", started.append)
    assert main(["serve", str(tmp_path), "-q", "fp8"]) == 0
    assert main(["serve", str(tmp_path), "--quantization", "modelopt_fp4"]) == 0
    assert [args.engine_args()["quantization"] for args in started] == ["fp8", "modelopt_fp4"]
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--quantization", "awq"])
