"""LoRA adapters (issue 55) on tiny NemotronH, Qwen3.5 (gated DeltaNet) and Jamba models: greedy
tokens identical to transformers + PEFT in fp32, one adapter at a time and several adapters and
the base model mixed in one batch; refused adapters named."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.gdn_families import gdn_models  # noqa: F401 (fixture)
from tests.lora_models import assert_mixed_batch_matches, make_adapter
from tests.reference import hf_greedy
from tests.ssm_families import ssm_models  # noqa: F401 (fixture)
from tests.tiny import save_tiny_model

NEW = 8
PROMPTS = [[5, 17, 42, 9, 33, 8, 71], [100, 3, 64, 12, 7, 250, 19, 2, 45, 60, 11]]
# What each family's adapters target (transformers' module names, as PEFT takes them)
NEMOTRON_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"]
QWEN35_TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
    "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj",
]  # fmt: skip
# Not dt_proj: transformers' Jamba reads `dt_proj.weight` directly (a matmul, not the module),
# so PEFT's dt_proj adapter has no effect on the reference (baton applies it)
JAMBA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "x_proj", "gate_proj",
                 "up_proj", "down_proj"]  # fmt: skip


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """(model dir, {adapter name: (dir, PEFT model)}, the base transformers model)."""
    root = tmp_path_factory.mktemp("lora-nemotron")
    hf = save_tiny_model(root / "model", seed=7)
    adapters = {}
    for i, name in enumerate(("alpha", "beta")):
        path = root / name
        adapters[name] = (path, make_adapter(hf, path, NEMOTRON_TARGETS, seed=10 + i))
    return root / "model", adapters, hf


def greedy(n=NEW):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_mixed(model_dir, adapters, hf, **engine):
    """Every prompt under every adapter and the base, in one generate call (one batch)."""
    llm = LLM(model_dir, enable_lora=True, max_loras=len(adapters), max_lora_rank=8, **engine)
    assert_mixed_batch_matches(llm, adapters, hf, PROMPTS, NEW)
    return llm


def test_nemotron_h_adapters_mixed_in_one_batch_match_transformers_peft(nemotron):
    model_dir, adapters, hf = nemotron
    check_mixed(model_dir, adapters, hf)


def test_adapter_changes_the_output(nemotron):
    """The test above could pass with adapters ignored only if they changed nothing."""
    model_dir, adapters, hf = nemotron
    base, _ = hf_greedy(hf, PROMPTS[0], NEW)
    tuned, _ = hf_greedy(adapters["alpha"][1], PROMPTS[0], NEW)
    assert base != tuned


def test_qwen3_5_gated_deltanet_adapters_match_transformers_peft(gdn_models, tmp_path):  # noqa: F811
    model_dir, hf = gdn_models("qwen3_5_dense")
    adapters = {
        name: (tmp_path / name, make_adapter(hf, tmp_path / name, QWEN35_TARGETS, seed=20 + i))
        for i, name in enumerate(("g1", "g2"))
    }
    check_mixed(model_dir, adapters, hf)


def test_jamba_mamba1_adapters_match_transformers_peft(ssm_models, tmp_path):  # noqa: F811
    model_dir, hf = ssm_models("jamba_dense")
    adapters = {
        name: (tmp_path / name, make_adapter(hf, tmp_path / name, JAMBA_TARGETS, seed=30 + i))
        for i, name in enumerate(("j1", "j2"))
    }
    check_mixed(model_dir, adapters, hf)


def test_qwen3_next_packed_qkvz_ba_and_shared_expert_adapters_match(gdn_models, tmp_path):  # noqa: F811
    """Qwen3-Next stores in_proj_qkvz / in_proj_ba interleaved per key head; baton reads the
    rows regrouped, and B's rows must follow the same regrouping."""
    model_dir, hf = gdn_models("qwen3_next_mixed")
    # Not gate/up/down: with transformers 5's fused experts PEFT turns those names into
    # target_parameters on the routed experts (tests/test_lora_moe.py)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]
    adapters = {
        name: (tmp_path / name, make_adapter(hf, tmp_path / name, targets, seed=90 + i))
        for i, name in enumerate(("n1", "n2"))
    }
    check_mixed(model_dir, adapters, hf)
