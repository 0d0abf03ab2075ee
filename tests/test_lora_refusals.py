"""Adapters baton cannot apply exactly are refused, with the module or option named; never
silently ignored (vLLM's open bug on gated DeltaNet). Plus the options it does apply: a regex
`target_modules`, use_rslora, a rank below --max-lora-rank."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, LoRARequest, SamplingParams
from baton.engine.lora.adapter import AdapterError
from tests.gdn_families import gdn_models  # noqa: F401 (fixture)
from tests.lora_models import make_adapter
from tests.reference import hf_greedy
from tests.tiny import save_tiny_model

PROMPT = [5, 17, 42, 9, 33, 8, 71]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-refusals")
    hf = save_tiny_model(root / "model", seed=11)
    llm = LLM(root / "model", enable_lora=True, max_loras=1, max_lora_rank=8)
    return root, hf, llm


def refused(llm, path, *needles):
    with pytest.raises(AdapterError) as error:
        llm.engine.add_lora(path.name, str(path))
    for needle in needles:
        assert needle in str(error.value), str(error.value)
    assert path.name not in llm.engine.list_loras()


def test_module_baton_cannot_adapt_is_named(base):
    root, hf, llm = base
    make_adapter(hf, root / "head", ["q_proj", "lm_head"], seed=1)
    refused(llm, root / "head", "lm_head")


def test_modules_to_save_and_bias_are_refused_by_name(base):
    root, hf, llm = base
    make_adapter(hf, root / "saved", ["q_proj"], seed=1, modules_to_save=["lm_head"])
    refused(llm, root / "saved", "modules_to_save")
    make_adapter(hf, root / "biased", ["q_proj"], seed=1, bias="lora_only")
    refused(llm, root / "biased", "bias")


def test_rank_over_max_lora_rank_is_refused(base):
    root, hf, llm = base
    make_adapter(hf, root / "wide", ["q_proj"], seed=1, r=16)
    refused(llm, root / "wide", "rank 16", "max-lora-rank 8")


def test_shape_mismatch_is_refused_with_the_module(base):
    root, hf, llm = base
    path = root / "misfit"
    make_adapter(hf, path, ["in_proj"], seed=1)
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    name = next(n for n in tensors if "layers.0.mixer.in_proj.lora_B" in n)
    tensors[name] = tensors[name][:-3].contiguous()
    save_file(tensors, str(file))
    refused(llm, path, "model.layers.0.mixer.in_proj", "output size")


def test_dora_and_unknown_tensors_are_refused(base):
    root, hf, llm = base
    path = root / "dora"
    make_adapter(hf, path, ["q_proj"], seed=1)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    refused(llm, path, "use_dora")
    path = root / "extra"
    make_adapter(hf, path, ["q_proj"], seed=1)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.embeddings.lora_embedding_A"] = torch.zeros(4, 8)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    refused(llm, path, "lora_embedding_A")


def test_request_for_an_unknown_adapter_is_refused(base):
    _, _, llm = base
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        llm.engine.add_request("x", PROMPT, SamplingParams(max_tokens=2, lora_name="nope"))


def test_regex_targets_rslora_and_a_smaller_rank_apply(base):
    """target_modules as a regex string (PEFT's full-match), rsLoRA scaling, rank 2 < 8."""
    root, hf, llm = base
    path = root / "regex"
    peft_model = make_adapter(hf, path, r".*layers\.[03]\.mixer\.(in_proj|q_proj|v_proj)", seed=3,
                              r=2, use_rslora=True)  # fmt: skip
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       lora_request=LoRARequest("regex", 1, str(path)))[0]  # fmt: skip
    assert out.token_ids == hf_greedy(peft_model, PROMPT, 8)[0]
    assert out.token_ids != hf_greedy(hf, PROMPT, 8)[0]


def test_target_parameter_baton_has_no_delta_for_is_refused_by_module(gdn_models, tmp_path):  # noqa: F811
    """Routed experts' stacked parameters are adapted (tests/test_lora_moe.py); a router's
    weight targeted through target_parameters is not, and is named."""
    model_dir, hf = gdn_models("qwen3_next_mixed")
    make_adapter(hf, tmp_path / "router", [], seed=2, target_parameters=["mlp.gate.weight"])
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    refused(llm, tmp_path / "router", "model.layers.1.mlp.gate", "cannot apply an adapter")
