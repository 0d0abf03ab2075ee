"""The gated DeltaNet families' config.json files as published (tests/fixtures/published_configs,
each folder's SOURCES.md says where from), shrunk in sizes only, built by transformers from that
file and run by baton from that same file: greedy tokens and logprobs must be transformers'
(fp32). A key baton misreads shows up as a refusal or as different logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_gdn_models import assert_matches_transformers
from tests.tiny import save_tokenizer, spread_parameters

PUBLISHED = Path(__file__).parent / "fixtures" / "published_configs"
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16)  # fmt: skip
# Per fixture, the size keys set (widths, heads, experts, layers, vocabulary); the key/value head
# ratio of the GDN (R) and the query/KV ratio are the published ones.
SHRUNK: dict[str, dict] = {
    "qwen3_next_80b_a3b_instruct": dict(
        vocab_size=512, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, num_hidden_layers=5, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=16, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    ),
    "qwen3_5_0_8b": dict(
        vocab_size=512, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=96, num_hidden_layers=5, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    ),
    "qwen3_5_35b_a3b": dict(
        vocab_size=512, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=1,
        num_hidden_layers=5, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=16,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    ),
}  # fmt: skip


def shrink(raw: dict, sizes: dict) -> dict:
    """The published file with its size keys replaced; a layer list keeps its published prefix."""
    out = json.loads(json.dumps(raw))
    text = out.get("text_config", out)
    text.update(sizes)
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
    if "vision_config" in out:
        out["vision_config"].update(VISION)
    return out


@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_published_config_runs_as_transformers_runs_it(tmp_path, name):
    import transformers

    raw = shrink(json.loads((PUBLISHED / name / "config.json").read_text()), SHRUNK[name])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(7)
    hf = getattr(transformers, raw["architectures"][0])(config).float().eval()
    spread_parameters(hf)
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))  # the published file, not a re-save
    save_tokenizer(tmp_path, vocab_size=512)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 70)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)  # fmt: skip
    outs = LLM(tmp_path, page_size=4, chunked_prefill_size=32).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out)
