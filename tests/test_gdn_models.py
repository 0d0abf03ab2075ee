"""Every gated DeltaNet architecture (tests/gdn_families.py: Qwen3-Next, Qwen3.5 dense and MoE as
causal LMs and vision checkpoints, OLMo-Hybrid; two or more tiny configs each) against
transformers in fp32, one engine per config: in one run, prompts batched, prefilled in chunks
beside decodes (mixed steps) and preempted for memory; greedy tokens are transformers' greedy
tokens, their logprobs and every prompt logprob within 1e-4.

The greedy check runs transformers once over prompt + generated tokens (teacher forcing): each
token must be transformers' argmax given the tokens before it (a near-tie excepted), which is
greedy equality by induction, at the cost of one forward instead of one per token."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.gdn_families import GDN_CONFIGS
from tests.reference import TIE_GAP, hf_prompt_logprobs

LENGTHS = (5, 23, 70)  # under one GDN chunk (64), several, across its boundary
NEW_TOKENS = 8
# 16-token prefill chunks beside the decodes; 21 pages of 4 cannot hold all three requests
# (2 + 8 + 20 pages at the end), so one is preempted and recomputed.
ENGINE = dict(page_size=4, chunked_prefill_size=16, max_num_batched_tokens=24, max_total_tokens=84)
TOLERANCE = 1e-4


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def assert_matches_transformers(hf, prompt: list[int], out) -> None:
    """out: a RequestOutput with logprobs=1 and prompt_logprobs=1."""
    ref = hf_prompt_logprobs(hf, prompt + out.token_ids)  # row i predicts token i + 1
    for step, token in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + step]
        gap = float(row.max() - row[token])
        assert gap < TIE_GAP, f"prompt {len(prompt)}: token {step} is not greedy (gap {gap:.2e})"
        assert abs(out.logprobs[step][token] - float(row[token])) < TOLERANCE, (len(prompt), step)
    for pos in range(1, len(prompt)):
        for token, lp in out.prompt_logprobs[pos].items():
            assert abs(lp - float(ref[pos - 1, token])) < TOLERANCE, (len(prompt), pos)


@pytest.mark.parametrize("name", list(GDN_CONFIGS))
def test_engine_matches_transformers(gdn_models, name):
    model_dir, hf = gdn_models(name)
    prompts = prompts_for(hf.config.get_text_config().vocab_size)
    llm = LLM(model_dir, **ENGINE)
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
