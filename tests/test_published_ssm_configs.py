"""config.json files of Jamba, LFM2, LFM2-MoE, Mamba, Falcon-Mamba and Mamba2 as published
(tests/fixtures/published_configs/<name>/, each with its SOURCES.md), shrunk in sizes only, built
by transformers from that file and run by baton from that same file: prompt logprobs and greedy
tokens must match transformers' (fp32). The traps they hold: LFM2's legacy `block_ff_dim` and
`full_attn_idxs` with the auto-adjusted FFN width, Falcon-Mamba's stored `intermediate_size`
against its `expand`, Jamba's period/offset layout, an infinite `time_step_limit`.

The comparison is on outputs, not on baton's config fields, so a key read differently from
transformers shows up as a refusal or as different logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from tests.reference import assert_greedy_matches, hf_greedy, hf_prompt_logprobs
from tests.tiny import save_tokenizer, spread_parameters

PUBLISHED = Path(__file__).parent / "fixtures" / "published_configs"

# the size keys each test sets; everything else is as published
SHRUNK: dict[str, dict] = {
    "jamba_1_5_mini": dict(
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=4,
        num_hidden_layers=8,  # one period: attention at 4, experts at the odd layers
        mamba_dt_rank=8,
        vocab_size=600,  # above its eos id 518
    ),
    "lfm2_1_2b": dict(
        hidden_size=64,
        num_attention_heads=8,
        num_heads=8,
        num_key_value_heads=2,
        block_ff_dim=96,
        num_hidden_layers=6,
        vocab_size=320,
    ),
    "lfm2_350m": dict(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        block_ff_dim=104,
        num_hidden_layers=6,
        vocab_size=320,
        architectures=["Lfm2ForCausalLM"],
    ),
    "lfm2_8b_a1b": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=8,
        num_hidden_layers=4,
        vocab_size=320,
        architectures=["Lfm2MoeForCausalLM"],
    ),
    "mamba_130m_hf": dict(
        hidden_size=64, intermediate_size=128, time_step_rank=8, num_hidden_layers=2, vocab_size=320
    ),
    "falcon_mamba_7b": dict(
        hidden_size=64, intermediate_size=128, time_step_rank=8, num_hidden_layers=2, vocab_size=320
    ),
    "mamba2_780m": dict(
        hidden_size=64,
        num_heads=8,
        head_dim=16,
        state_size=16,
        num_hidden_layers=2,
        vocab_size=320,
        architectures=["Mamba2ForCausalLM"],
        bos_token_id=0,
        eos_token_id=0,
    ),
}


def shrunk(name: str) -> dict:
    raw = json.loads((PUBLISHED / name / "config.json").read_text())
    raw.update(SHRUNK[name])
    if "layer_types" in raw:  # the published layout's first layers
        raw["layer_types"] = raw["layer_types"][: raw["num_hidden_layers"]]
    return raw


@pytest.mark.parametrize("name", list(SHRUNK))
def test_published_config_runs_as_transformers_runs_it(tmp_path, name):
    import transformers

    raw = shrunk(name)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    spread_parameters(hf)
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))  # baton reads the file as published
    save_tokenizer(tmp_path, vocab_size=raw["vocab_size"])
    prompt = torch.randint(3, raw["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    llm = LLM(tmp_path, page_size=4, chunked_prefill_size=16)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    )[0]
    ref = hf_prompt_logprobs(hf, prompt)
    for pos in range(1, len(prompt)):
        for token, lp in out.prompt_logprobs[pos].items():
            assert abs(lp - float(ref[pos - 1, token])) < 1e-4, (pos, token)
    tokens, logprobs = hf_greedy(hf, prompt, 6)
    assert assert_greedy_matches(out.token_ids, tokens, logprobs, name) >= 5
