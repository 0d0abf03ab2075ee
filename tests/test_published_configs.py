"""config.json files as the model makers published them (tests/fixtures/published_configs,
sources in its SOURCES.md), each shrunk in sizes only, built by transformers from that file and
run by baton from that same file: greedy tokens and logprobs must match transformers' (fp32).

The comparison is on outputs, not on baton's config fields, so a key baton misreads (a value
transformers treats as "off" that baton refuses, a default taken where the file says
otherwise) shows up as a refusal or as different logits, whatever the config code looks like.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from tests.reference import assert_greedy_matches, hf_greedy
from tests.tiny import align_dt_limit, spread_parameters

FIXTURES = Path(__file__).parent / "fixtures"
PUBLISHED = FIXTURES / "published_configs"

# Layer-layout keys: shrunk to the shortest prefix holding every kind of layer the model has
# (plus one layer), so the layout's structure (kinds, their order) is the published one.
LAYOUT_KEYS = ("layer_types", "hybrid_override_pattern", "layers_block_type")

# Per fixture, the size keys a test sets (widths, heads, experts, the vocabulary, layer counts):
# everything else is kept as published (token ids past the small vocabulary, such as Granite's
# eos 100257, are only read to stop, and these runs ignore EOS). Widths keep the published ratios that transformers checks
# (query heads per KV head, Mamba heads per group, Mamba width = heads x head dim).
SHRUNK: dict[str, dict] = {
    "granite_4_0_h_350m": dict(
        vocab_size=512,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=24,
        intermediate_size=16,
        shared_intermediate_size=24,
    ),
    "granite_4_0_h_1b": dict(
        vocab_size=512,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=24,
        intermediate_size=16,
        shared_intermediate_size=24,
    ),
    "granite_4_0_h_micro": dict(
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        intermediate_size=16,
        shared_intermediate_size=24,
    ),
    "granite_4_0_h_tiny": dict(
        vocab_size=512,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=24,
        intermediate_size=16,
        shared_intermediate_size=24,
        num_local_experts=8,
    ),
    "bamba_9b": dict(
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        attn_rotary_emb=4,
        mamba_n_heads=4,
        mamba_d_head=32,
        intermediate_size=32,
    ),
    "nemotron_nano_9b_v2": dict(
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=8,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        intermediate_size=32,
        # not in the copies found (SOURCES.md); any id does for a run that ignores EOS
        eos_token_id=2,
    ),
    "falcon_h1_0_5b": dict(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_ssm=32,
        intermediate_size=32,
        num_hidden_layers=2,
        vocab_size=512,
    ),
    "zamba2_2_7b_instruct_v2": dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_hidden_size=64,
        attention_head_dim=16,
        kv_channels=8,
        n_mamba_heads=4,
        mamba_headdim=16,
        intermediate_size=48,
        ffn_hidden_size=48,
        adapter_rank=4,
        vocab_size=512,
    ),
    "nemotron3_nano_30b_a3b": dict(
        vocab_size=512,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=16,
        n_routed_experts=8,
    ),
}
NAMES = sorted(SHRUNK)
# The configs of the Granite-4.0-H family: every one says position_embedding_type "nope".
GRANITE = [n for n in NAMES if n.startswith("granite")]


def published(name: str) -> dict:
    directory = PUBLISHED / name
    if not directory.is_dir():  # the Nemotron 3 Nano fixture predates this suite
        directory = FIXTURES / name
    return json.loads((directory / "config.json").read_text())


def shortest_layout(layout: list | str) -> list | str:
    """The shortest prefix holding every layer kind of `layout`, plus one layer."""
    kinds = set(layout)
    end = next(i for i in range(1, len(layout) + 1) if set(layout[:i]) == kinds)
    return layout[: min(end + 1, len(layout))]


def shrink(name: str, raw: dict) -> dict:
    """The published config with small sizes: SHRUNK's keys and a shorter layout (with the keys
    that restate it: the layer count, Bamba's attention indices, Zamba2's hybrid ids)."""
    small = {**raw, **SHRUNK[name]}
    for key in LAYOUT_KEYS:
        if key in raw:
            layout = shortest_layout(raw[key])
            small[key] = layout
            small["num_hidden_layers"] = len(layout)
    if "attn_layer_indices" in raw and raw["attn_layer_indices"]:
        first = raw["attn_layer_indices"][0]
        small["num_hidden_layers"] = first + 2
        small["attn_layer_indices"] = [first]
    if "hybrid_layer_ids" in raw:
        small["hybrid_layer_ids"] = [
            i for i, kind in enumerate(small["layers_block_type"]) if kind == "hybrid"
        ]
    return small


def build_reference(directory: Path, config: dict, seed: int):
    """transformers' model for `config` as the file says it (AutoConfig reads the file), fp32,
    saved there; config.json is then the published one again (save_pretrained rewrites it in
    transformers' own spelling, which is not what a user downloads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(directory)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    spread_parameters(model)
    align_dt_limit(model)
    model.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(config))
    return model


def test_shrinking_changes_sizes_only():
    for name in NAMES:
        raw = published(name)
        small = shrink(name, raw)
        size_keys = {*SHRUNK[name], *LAYOUT_KEYS, "num_hidden_layers", "attn_layer_indices"}
        size_keys |= {"hybrid_layer_ids", "eos_token_id"}
        assert set(small) <= set(raw) | size_keys, name
        for key, value in raw.items():
            if key not in size_keys:
                assert small[key] == value, (name, key)


@pytest.mark.parametrize("name", GRANITE)
def test_granite_published_configs_say_nope(name):
    """The finding: every published Granite-4.0-H file names NoPE so, which baton refused."""
    assert published(name)["position_embedding_type"] == "nope"


@pytest.mark.parametrize("name", NAMES)
def test_published_config_matches_transformers(tmp_path, name):
    config = shrink(name, published(name))
    hf = build_reference(tmp_path, config, seed=7)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 21)]
    llm = LLM(tmp_path, dtype="float32", page_size=4, chunked_prefill_size=16)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    )
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(hf, prompt, 6)
        upto = assert_greedy_matches(out.token_ids, ref, ref_lp, f"{name} prompt {len(prompt)}")
        for step in range(upto):
            token = out.token_ids[step]
            got, want = out.logprobs[step][token], float(ref_lp[step, token])
            assert abs(got - want) < 1e-4, (name, len(prompt), step, got, want)
