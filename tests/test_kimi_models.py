"""Kimi Linear (tests/kimi_models.py: dense first layers + MoE, two dense layers with a low-rank
query, MoE only), Bailing hybrid (bounded and softplus decay, rotary MLA with a head gate) and
MiniMax (lightning attention with softmax attention in one layer of four; alternating, windowed)
against transformers in fp32, one engine per config: in one run, prompts batched,
prefilled in chunks beside decodes (mixed steps) and preempted for memory; greedy tokens are
transformers' greedy tokens, their logprobs and every prompt logprob within 1e-4 (teacher
forcing, tests/test_gdn_models.py). Pools are empty at the end."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.kimi_models import BAILING_CONFIGS, KIMI_CONFIGS, MINIMAX_CONFIGS
from tests.test_gdn_models import NEW_TOKENS, assert_matches_transformers, prompts_for
from tests.window_models import preempting


@pytest.mark.parametrize("name", [*KIMI_CONFIGS, *BAILING_CONFIGS, *MINIMAX_CONFIGS])
def test_engine_matches_transformers(kimi_models, name):
    model_dir, hf = kimi_models(name)
    prompts, args = preempting(model_dir, hf.config.vocab_size, prompts_for(hf.config.vocab_size))
    llm = LLM(model_dir, **args)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert {"mixed", "decode", "extend"} <= set(modes)
    assert stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
        assert_matches_transformers(hf, prompt, out)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
