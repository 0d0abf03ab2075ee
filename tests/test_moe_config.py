"""MoE config keys and checkpoints: transformers' defaults, clear errors, the real
Nemotron-3-Nano-30B-A3B config (fixture) and a scaled-down copy of it vs transformers, per-expert
and MTP tensors in the loader."""

from __future__ import annotations

import inspect
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.engine.checkpoint.loader import load_model
from baton.engine.checkpoint.weights import WeightError
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.reference import assert_greedy_matches, hf_greedy
from tests.tiny import save_tiny_model

NANO = Path(__file__).parent / "fixtures" / "nemotron3_nano_30b_a3b" / "config.json"


def nemotron_h_default(key: str):
    from transformers import NemotronHConfig

    return inspect.signature(NemotronHConfig.__init__).parameters[key].default


def test_nano_30b_a3b_config_parses():
    config = ModelConfig.from_hf(NANO.parent)
    hybrid = config.family
    pattern = json.loads(NANO.read_text())["hybrid_override_pattern"]
    assert hybrid.num_layers == len(pattern) == 52
    assert hybrid.layer_types.count("moe") == 23 and hybrid.layer_types.count("mamba") == 23
    assert hybrid.attention_layer_ids == (5, 12, 19, 26, 33, 42)
    attention, mamba = hybrid.attention, hybrid.mamba
    assert (config.hidden_size, attention.num_heads, attention.num_kv_heads) == (2688, 32, 2)
    assert (mamba.num_heads, mamba.head_dim, mamba.n_groups) == (64, 64, 8)
    assert mamba.conv_dim == 6144
    moe = hybrid.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 6, 1856)
    assert (moe.shared_intermediate_size, moe.latent_size, moe.activation) == (3712, None, "relu2")
    assert (moe.n_group, moe.topk_group, moe.norm_topk_prob) == (1, 1, True)
    assert moe.routed_scaling_factor == 2.5
    assert mamba.time_step_limit == (0.0, float("inf"))  # absent: transformers' default
    assert config.num_nextn_predict_layers == 0


def test_missing_keys_take_transformers_defaults(base_model):
    """n_groups was 1 in baton when missing; transformers builds 8 groups."""
    model_dir, _ = base_model
    raw = json.loads((model_dir / "config.json").read_text())
    keys = ["n_groups", "head_dim", "num_key_value_heads", "chunk_size", "conv_kernel"]
    # 16 attention and 16 Mamba heads: the defaults (8 KV heads, 8 groups) must divide them.
    kept = {k: v for k, v in raw.items() if k not in keys}
    config = ModelConfig.from_dict(dict(kept, num_attention_heads=16, mamba_num_heads=16))
    hybrid = config.family
    read = {
        "n_groups": hybrid.mamba.n_groups,
        "head_dim": hybrid.attention.head_dim,
        "num_key_value_heads": hybrid.attention.num_kv_heads,
        "chunk_size": hybrid.mamba.chunk_size,
        "conv_kernel": hybrid.mamba.conv_kernel,
    }
    for key in keys:
        assert read[key] == nemotron_h_default(key), key
    moe_raw = dict(raw, layers_block_type=["linear_attention", "moe"])
    for key in ("n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "n_group"):
        moe_raw.pop(key, None)
    moe = ModelConfig.from_dict(moe_raw).family.moe
    assert moe.num_experts == nemotron_h_default("n_routed_experts")
    assert moe.top_k == nemotron_h_default("num_experts_per_tok")
    assert moe.routed_scaling_factor == nemotron_h_default("routed_scaling_factor")
    assert moe.n_group == nemotron_h_default("n_group")


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(n_group=3), "n_group"),
        (dict(n_group=8), "n_group"),  # one expert per group: no "two best" to sum
        (dict(n_group=2, topk_group=3), "topk_group"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(n_shared_experts=2), "n_shared_experts"),
        (dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
        (dict(mamba_hidden_act="relu"), "mamba_hidden_act"),
    ],
)
def test_keys_baton_cannot_honour_are_named(base_model, change, key):
    model_dir, _ = base_model
    raw = json.loads((model_dir / "config.json").read_text())
    raw = {**raw, "layers_block_type": ["linear_attention", "moe"], "n_routed_experts": 8, **change}
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(raw)


def scaled_down_nano() -> dict:
    """The fixture with small widths and vocabulary; the 52-layer pattern and the routing
    (128 experts, top-6, n_group 1, renormalised, x2.5) unchanged."""
    raw = json.loads(NANO.read_text())
    raw.update(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=16,
        moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=16,
        vocab_size=320,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    for key in ("auto_map", "transformers_version", "num_hidden_layers", "torch_dtype"):
        raw.pop(key)
    return raw


def test_scaled_down_nano_is_token_identical_to_transformers(tmp_path):
    kwargs = scaled_down_nano()
    pattern = kwargs.pop("hybrid_override_pattern")
    hf = save_tiny_model(
        tmp_path, seed=4, tokenizer=False, hybrid_override_pattern=pattern, **kwargs
    )
    config = ModelConfig.from_hf(tmp_path)
    moe = config.family.moe
    assert moe.num_experts == 128 and moe.top_k == 6 and config.family.num_layers == 52
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 29)]
    llm = LLM(tmp_path, page_size=4, chunked_prefill_size=16)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    )
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(hf, prompt, 8)
        upto = assert_greedy_matches(out.token_ids, ref, ref_lp, f"prompt {len(prompt)}")
        assert upto >= 6
        for step in range(upto):
            token = out.token_ids[step]
            assert abs(out.logprobs[step][token] - float(ref_lp[step, token])) < 1e-4


def _logits(model_dir, tokens):
    llm = LLM(model_dir, page_size=4)
    (out,) = llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return [next(iter(e.values())) for e in out.prompt_logprobs[1:]]


def test_sharded_moe_checkpoint_with_mtp_tensors_loads(tiny_models, tmp_path, caplog):
    """save_pretrained's sharded layout; MTP tensors (a Nemotron 3 Super checkpoint) are skipped
    with one log line."""
    model_dir, hf = tiny_models("moe_latent")
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    extra = load_file(shards[0])
    extra["mtp.layers.0.mixer.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    extra["mtp.layers.0.norm.weight"] = torch.zeros(2)
    save_file(extra, shards[0], metadata={"format": "pt"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: shards[0].name for k in extra if k.startswith("mtp.")})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    with caplog.at_level(logging.INFO, logger="baton.engine.checkpoint.weights"):
        tokens = list(range(3, 30))
        assert _logits(tmp_path, tokens) == _logits(model_dir, tokens)
    assert [r.message for r in caplog.records if "mtp" in r.message] == [
        f"{tmp_path}: skipped 2 multi-token-prediction (mtp.*) tensors"
    ]


def test_missing_expert_is_named_by_its_checkpoint_name(tiny_models, tmp_path):
    model_dir, _ = tiny_models("moe_nano")
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["backbone.layers.1.mixer.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"model\.layers\.1\.mixer\.experts\.3\.up_proj\.weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_bf16_model_keeps_its_router_in_float32(tiny_models):
    model_dir, _ = tiny_models("moe_grouped")
    model = load_model(model_dir, torch.bfloat16, "cpu")
    fp32 = load_model(model_dir, torch.float32, "cpu")
    block = model.model.layers[1].mixer
    assert block.gate.weight.dtype == torch.float32
    assert block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.experts.up_proj.dtype == torch.bfloat16
    torch.testing.assert_close(
        block.gate.weight, fp32.model.layers[1].mixer.gate.weight, atol=0, rtol=0
    )


def test_stacked_expert_tensors_load_too(tiny_models, tmp_path):
    """A checkpoint holding each layer's experts as one (E, out, in) tensor, as transformers
    keeps them in memory, loads into the same model as the per-expert layout."""
    model_dir, _ = tiny_models("moe_nano")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    tensors = load_file(model_dir / "model.safetensors")
    stacked = {}
    for name in list(tensors):
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            key = ".".join(parts[: at + 1] + [parts[at + 2]])
            stacked.setdefault(key, {})[int(parts[at + 1])] = tensors.pop(name)
    assert stacked  # the per-expert layout really was there
    for key, rows in stacked.items():
        tensors[key] = torch.stack([rows[e] for e in sorted(rows)])
    save_file(tensors, tmp_path / "model.safetensors")
    tokens = list(range(3, 30))
    assert _logits(tmp_path, tokens) == _logits(model_dir, tokens)
