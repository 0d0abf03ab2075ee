"""The padded decode runner (CUDA graphs on GPU, the same padded step on CPU)."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.executor.forward_metadata import ScheduledBatch, TrackPoint
from baton.engine.executor.graph_runner import DecodeGraphRunner, capture_sizes
from baton.engine.executor.model_runner import ModelRunner
from tests.same_outputs import assert_same_outputs

PAGE = 4


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]


def setup(model_dir):
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu")
    caches = [
        StateCache.for_model(
            config,
            num_pages=80,
            page_size=PAGE,
            num_slots=20,
            dtype=torch.float32,
            device="cpu",
        )
        for _ in range(2)
    ]
    return config, model, caches


def prefill_all(runner, prompts, pages, slots):
    for i, prompt in enumerate(prompts):
        runner.forward(
            ScheduledBatch(
                mode="extend",
                request_ids=(f"r{i}",),
                num_decode_seqs=0,
                num_verify_seqs=0,
                input_ids=tuple(prompt),
                seq_lens=(len(prompt),),
                start_positions=(0,),
                kv_pages=(pages[i],),
                mamba_slots=(slots[i],),
                verify_slots=(),
                logits_seqs=(0,),
                prompt_logprob_seqs=(),
                has_mamba_track_mask=False,
                track_points=(),
                lora_slots=(-1,) * len((f"r{i}",)),
            )
        )


@pytest.mark.parametrize("n", [3, 5, 7])
def test_padded_decode_equals_eager_and_dummy_slot_absorbs_padding(base_model, n):
    model_dir, _ = base_model
    config, model, (eager_cache, padded_cache) = setup(model_dir)
    g = torch.Generator().manual_seed(n)
    prompts = [
        torch.randint(
            3, config.vocab_size, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    pages = [tuple(range(1 + 8 * i, 9 + 8 * i)) for i in range(n)]
    slots = [2 + i for i in range(n)]
    eager = ModelRunner(model, eager_cache, "cpu")
    padded = DecodeGraphRunner(
        ModelRunner(model, padded_cache, "cpu"),
        max_bs=8,
        kv_capacity=64,
        capture=None,
        verify_width=None,
    )
    prefill_all(eager, prompts, pages, slots)
    prefill_all(padded.runner, prompts, pages, slots)
    padded_cache.pools["mamba2.conv"][:, 0] = (
        7.0  # the dummy slot holds junk; live rows must not see it
    )
    for step in range(3):
        track = step == 1
        points = (
            tuple(TrackPoint(seq_index=i, token_offset=0, dst_slot=12 + i) for i in range(0, n, 2))
            if track
            else ()
        )
        sched = ScheduledBatch(
            mode="decode",
            request_ids=tuple(f"r{i}" for i in range(n)),
            num_decode_seqs=n,
            num_verify_seqs=0,
            input_ids=tuple(5 + i + step for i in range(n)),
            seq_lens=(1,) * n,
            start_positions=tuple(len(p) + step for p in prompts),
            kv_pages=tuple(pages),
            mamba_slots=tuple(slots),
            verify_slots=(),
            logits_seqs=tuple(range(n)),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=track,
            track_points=points,
            lora_slots=(-1,) * len(tuple(f"r{i}" for i in range(n))),
        )
        _, ref = eager.forward(sched)
        _, got = padded.forward(sched)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    live = slots + [12 + i for i in range(0, n, 2)]
    torch.testing.assert_close(
        padded_cache.pools["mamba2.ssm"][:, live],
        eager_cache.pools["mamba2.ssm"][:, live],
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        padded_cache.pools["mamba2.conv"][:, live],
        eager_cache.pools["mamba2.conv"][:, live],
        atol=1e-6,
        rtol=1e-6,
    )
    assert (
        padded_cache.pools["mamba2.ssm"][:, 12].abs().sum() > 0
    )  # checkpoints taken inside the padded step
    if n not in padded.sizes:
        assert not torch.equal(
            padded_cache.pools["mamba2.conv"][:, 0],
            torch.full_like(padded_cache.pools["mamba2.conv"][:, 0], 7.0),
        )  # padding wrote there
    for slot in range(1, 20):
        if slot not in live:
            assert (
                padded_cache.pools["mamba2.ssm"][:, slot].abs().sum() == 0
            )  # no padded write escaped slot 0


def test_padding_never_lands_on_a_live_slot(base_model):
    model_dir, _ = base_model
    _, model, (cache, _) = setup(model_dir)
    runner = DecodeGraphRunner(
        ModelRunner(model, cache, "cpu"),
        max_bs=4,
        kv_capacity=32,
        capture=None,
        verify_width=None,
    )
    bad = ScheduledBatch(
        mode="decode",
        request_ids=("a",),
        num_decode_seqs=1,
        num_verify_seqs=0,
        input_ids=(5,),
        seq_lens=(1,),
        start_positions=(3,),
        kv_pages=((1,),),
        mamba_slots=(0,),
        verify_slots=(),
        logits_seqs=(0,),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * len(("a",)),
    )
    with pytest.raises(AssertionError, match="dummy"):
        runner.forward(bad)


def test_engine_with_padded_runner_matches_cache_on_and_off(base_model):
    model_dir, hf = base_model
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
        for n in (7, 33, 60, 5, 90)
    ]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    plain = LLM(model_dir, page_size=4, enable_prefix_caching=False).generate(prompts, params)
    padded_llm = LLM(
        model_dir,
        page_size=4,
        cpu_padded_decode=True,
        mamba_track_interval=32,
        max_running_requests=6,
        max_mamba_slots=16,  # slots to spare for checkpoints while all five decode
    )
    first = padded_llm.generate(prompts, params)
    # Each second turn repeats 30 tokens of its answer: decoding the first turn (40 tokens past
    # the prompt) crossed a block boundary, checkpointed by a padded decode step.
    turns = [p + o.token_ids[:30] + [9] for p, o in zip(prompts, first)]
    again = padded_llm.generate(turns, params)
    reference = LLM(model_dir, page_size=4, enable_prefix_caching=False).generate(turns, params)
    assert padded_llm.engine.graph_runner.num_padded_steps > 0
    assert padded_llm.engine.stats().mamba_checkpoints_decode > 0
    assert_same_outputs(first, plain)
    assert_same_outputs(again, reference)
    past_prompt = [
        o.num_cached_tokens > len(p) // 32 * 32 for p, o in zip(prompts, again)
    ]  # decode-time checkpoints: hits past the blocks of the first turn's prompt
    assert past_prompt == [True, False, True, True, True]  # 33 + 30 + 1 tokens: only block 32
