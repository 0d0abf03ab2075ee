"""Speculative decoding in the engine: verify steps, acceptance and rollback leave greedy output
token for token what plain decoding gives, under batching, chunked prefill, batches that mix
verify rows with prefill chunks, preemption and prefix caching. A scripted drafter proposes the
reference continuation with one wrong token moving through every position, so every acceptance
count from 0 to k is exercised (tests/spec_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.core.scheduler_spec import Speculation
from tests.spec_helpers import ScriptedDrafter, greedy_reference, ngram_config, scripted_llm

PROMPTS = [
    [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5],
    list(range(20, 57)),
    [40, 41, 40, 41, 40, 41, 42],
    [7] * 3 + list(range(90, 110)),
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def plain_outputs(tiny_models):
    """A tiny model's outputs for PROMPTS without speculation (the oracle), computed once."""
    computed = {}

    def get(name: str):
        if name not in computed:
            model_dir, _ = tiny_models(name)
            computed[name] = LLM(model_dir).generate(PROMPTS, GREEDY)
        return computed[name]

    return get


def assert_same_outputs(reference_outputs, outputs) -> None:
    for want, got in zip(reference_outputs, outputs):
        assert got.token_ids == want.token_ids
        for lp_want, lp_got in zip(want.logprobs, got.logprobs):  # accepted tokens: as without
            assert lp_want.keys() == lp_got.keys()
            assert max(abs(lp_want[t] - lp_got[t]) for t in lp_want) < 1e-4


@pytest.mark.parametrize("model", ["base", "moe_nano"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_verify_with_every_acceptance_count_matches_plain_decoding(
    tiny_models, plain_outputs, model, k
):
    model_dir, _ = tiny_models(model)
    want = plain_outputs(model)
    reference = {tuple(p): out.token_ids for p, out in zip(PROMPTS, want)}
    llm = scripted_llm(model_dir, reference, k)
    assert_same_outputs(want, llm.generate(PROMPTS, GREEDY))
    stats = llm.stats()
    # every acceptance count occurred: position i accepted in fewer rows than position i - 1
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == k and all(n > 0 for n in per_pos)
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_verify_rows_mixed_with_prefill_chunks(base_model, monkeypatch):
    """Requests arrive while others verify: steps carry decode, verify and prefill rows at once
    (prefills chunked at 8 tokens), and outputs stay those of plain decoding."""
    model_dir, _ = base_model
    engine_args = dict(chunked_prefill_size=8, max_num_batched_tokens=32)
    reference = greedy_reference(model_dir, PROMPTS, GREEDY, **engine_args)
    llm = scripted_llm(model_dir, reference, 2, **engine_args)
    engine = llm.engine
    modes = []
    forward = engine.forward

    def record(sched):
        modes.append((sched.mode, sched.num_verify_seqs, sched.num_seqs))
        return forward(sched)

    monkeypatch.setattr(engine, "forward", record)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
        for _ in range(3):  # the next request arrives while this one decodes
            for delta in engine.step():
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == [reference[tuple(p)] for p in PROMPTS]
    assert any(mode == "mixed" and nv > 0 for mode, nv, _ in modes), modes


def test_preemption_during_speculation_keeps_outputs(base_model, plain_outputs):
    model_dir, _ = base_model
    engine_args = dict(max_total_tokens=160, page_size=4)
    reference = {tuple(p): out.token_ids for p, out in zip(PROMPTS, plain_outputs("base"))}
    llm = scripted_llm(model_dir, reference, 2, **engine_args)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [reference[tuple(p)] for p in PROMPTS]
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_prefix_cache_checkpoints_at_accepted_positions_equal_plain_decoding(base_model):
    """Blocks end inside verify rows (interval 16, 24 new tokens): the checkpoints copied from
    the accepted positions' slots hold the same states as plain decoding's, and a second round
    of the same prompts hits them."""
    model_dir, _ = base_model
    engine_args = dict(page_size=4, mamba_track_interval=16)
    plain = LLM(model_dir, **engine_args)
    want = plain.generate(PROMPTS, GREEDY)
    reference = {tuple(p): out.token_ids for p, out in zip(PROMPTS, want)}
    spec = scripted_llm(model_dir, reference, 2, **engine_args)
    assert_same_outputs(want, spec.generate(PROMPTS, GREEDY))
    plain_blocks, spec_blocks = plain.engine.prefix_cache.blocks, spec.engine.prefix_cache.blocks
    assert plain_blocks.keys() == spec_blocks.keys() and len(spec_blocks) > len(PROMPTS)
    for key, block in spec_blocks.items():
        for name in spec.engine.cache.checkpointed:
            got = spec.engine.cache.pools[name][:, block.checkpoint_slot]
            ref = plain.engine.cache.pools[name][:, plain_blocks[key].checkpoint_slot]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    again = [p + reference[tuple(p)][:20] for p in PROMPTS]
    second_ref = greedy_reference(model_dir, again, GREEDY, **engine_args)
    spec.engine.drafter.reference = second_ref
    outputs = spec.generate(again, GREEDY)
    assert [o.token_ids for o in outputs] == [second_ref[tuple(p)] for p in again]
    assert spec.stats().prefix_cache_hit_tokens > 0


def keep_state_of_last_draft(self, req, start, slots, kept):
    """Speculation.accept without the rollback: the state after the last fed draft stays."""
    if slots[-1] != req.mamba_slot:
        i = req.spec_slots.index(slots[-1])
        req.spec_slots[i], req.mamba_slot = req.mamba_slot, slots[-1]


def test_skipping_the_rollback_is_caught(base_model, plain_outputs, monkeypatch):
    """Leaving the state after a rejected draft in place changes the output: the identity
    checks above would fail without the rollback."""
    model_dir, _ = base_model
    want = plain_outputs("base")
    reference = {tuple(p): out.token_ids for p, out in zip(PROMPTS, want)}
    monkeypatch.setattr(Speculation, "accept", keep_state_of_last_draft)
    outputs = scripted_llm(model_dir, reference, 2).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] != [o.token_ids for o in want]


def test_ngram_drafts_keep_outputs_and_are_accepted_on_repetitive_text(base_model):
    model_dir, _ = base_model
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6 + [9]]
    want = LLM(model_dir).generate(prompts, GREEDY)
    llm = LLM(model_dir, speculative_config=ngram_config(3) | {"prompt_lookup_min": 1})
    assert_same_outputs(want, llm.generate(prompts, GREEDY))
    assert llm.stats().spec_decode_num_drafts > 0


def test_disable_by_batch_size_verifies_only_below_it(base_model, monkeypatch):
    """With disable_by_batch_size 3, steps with 3 requests or more in the engine (running or
    waiting) verify nothing; once the short requests end, the others speculate again, and
    outputs stay those of plain decoding."""
    model_dir, _ = base_model
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 6, 24, 24)]
    want = LLM(model_dir).generate(PROMPTS, params)
    reference = {tuple(p): out.token_ids for p, out in zip(PROMPTS, want)}
    llm = LLM(model_dir, speculative_config=ngram_config(2) | {"disable_by_batch_size": 3})
    llm.engine.drafter = ScriptedDrafter(reference, 2, llm.engine.model_config.vocab_size)
    steps = []
    forward = llm.engine.forward

    def record(sched):
        scheduler = llm.engine.scheduler
        steps.append((len(scheduler.running) + len(scheduler.waiting), sched.num_verify_seqs))
        return forward(sched)

    monkeypatch.setattr(llm.engine, "forward", record)
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(verifying == 0 for in_engine, verifying in steps if in_engine >= 3)
    assert any(verifying > 0 for _, verifying in steps)


def test_disable_by_batch_size_counts_the_requests_waiting_for_the_batch(base_model, monkeypatch):
    """Two run at a time, two wait: with disable_by_batch_size 3 nothing verifies while the
    queue is there (the batch is about to refill), only once the last two run alone."""
    model_dir, _ = base_model
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(model_dir, max_running_requests=2).generate(PROMPTS, params)
    reference = {tuple(p): out.token_ids for p, out in zip(PROMPTS, want)}
    llm = LLM(
        model_dir,
        max_running_requests=2,
        speculative_config=ngram_config(2) | {"disable_by_batch_size": 3},
    )
    llm.engine.drafter = ScriptedDrafter(reference, 2, llm.engine.model_config.vocab_size)
    steps = []
    forward = llm.engine.forward

    def record(sched):
        steps.append((len(llm.engine.scheduler.waiting), sched.num_verify_seqs))
        return forward(sched)

    monkeypatch.setattr(llm.engine, "forward", record)
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(waiting for waiting, _ in steps)
    assert all(verifying == 0 for waiting, verifying in steps if waiting)
    assert any(verifying > 0 for _, verifying in steps)
