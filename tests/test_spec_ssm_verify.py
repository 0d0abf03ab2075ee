"""Verify steps on the Mamba1 and short-convolution families (Jamba, Mamba, Falcon-Mamba, LFM2,
a conv-only LFM2): each keeps its conv window and selective-scan state after every drafted
position in that position's slot (kernels/verify_steps.py), acceptance picks one, and greedy
output stays token for token (logprobs within 1e-4) what plain decoding gives, with every
acceptance count from 0 to k (a scripted drafter, tests/spec_helpers.py), and the prefix-cache
checkpoints copied from accepted positions equal plain decoding's. Before these paths, a
speculative config on these families sent verify rows down the prefill kernels (a crash)."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.core.scheduler_spec import Speculation
from tests.spec_helpers import scripted_llm
from tests.test_spec_engine import keep_state_of_last_draft

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
ENGINE = dict(page_size=4, mamba_track_interval=64)


def prompts_for(vocab: int) -> list[list[int]]:
    """Short ones, and ones whose decoding crosses the checkpoint at 64 inside verify rows."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 50, 57)]


@pytest.fixture(scope="module")
def plain_run(ssm_models):
    """name -> (prompts, plain engine after generating them, its outputs), computed once."""
    computed = {}

    def get(name: str):
        if name not in computed:
            model_dir, hf = ssm_models(name)
            prompts = prompts_for(hf.config.vocab_size)
            llm = LLM(model_dir, **ENGINE)
            computed[name] = (prompts, llm, llm.generate(prompts, GREEDY))
        return computed[name]

    return get


@pytest.mark.parametrize(
    ("name", "k"),
    [("jamba_moe", 2), ("mamba_a", 3), ("falcon_mamba_a", 1), ("lfm2_a", 2), ("lfm2_conv_only", 3)],
)
def test_every_acceptance_count_keeps_outputs_and_checkpoints(ssm_models, plain_run, name, k):
    model_dir, _ = ssm_models(name)
    prompts, plain, want = plain_run(name)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, want)}
    spec = scripted_llm(model_dir, reference, k, **ENGINE)
    got = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):
        assert all(
            abs(a.logprobs[i][t] - b.logprobs[i][t]) < 1e-4 for i, t in enumerate(a.token_ids)
        )
    stats = spec.stats()
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos)
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == k
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    plain_blocks, spec_blocks = plain.engine.prefix_cache.blocks, spec.engine.prefix_cache.blocks
    assert plain_blocks.keys() == spec_blocks.keys() and len(spec_blocks) >= 2
    for key, block in spec_blocks.items():
        for pool in spec.engine.cache.checkpointed:
            got_state = spec.engine.cache.pools[pool][:, block.checkpoint_slot]
            want_state = plain.engine.cache.pools[pool][:, plain_blocks[key].checkpoint_slot]
            torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["jamba_moe", "lfm2_a"])
def test_skipping_the_rollback_is_caught(ssm_models, plain_run, monkeypatch, name):
    """Leaving the state after a rejected draft in place changes the output: the identity check
    above would fail without the rollback."""
    model_dir, _ = ssm_models(name)
    prompts, _, want = plain_run(name)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, want)}
    monkeypatch.setattr(Speculation, "accept", keep_state_of_last_draft)
    got = scripted_llm(model_dir, reference, 2, **ENGINE).generate(prompts, GREEDY)
    assert [o.token_ids for o in got] != [o.token_ids for o in want]
