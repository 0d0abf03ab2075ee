"""A bf16 model's float32 logits on the CPU are widened into a buffer kept across forwards
(engine/layers/causal_lm.py): each forward's logits equal its lm_head output widened, whatever
the previous forward left in the buffer, and the storage is reused rather than allocated anew."""

from __future__ import annotations

import torch

from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.executor.forward_metadata import ScheduledBatch
from baton.engine.executor.model_runner import ModelRunner


def _prefill(tokens: list[int], slot: int, pages: list[int]) -> ScheduledBatch:
    return ScheduledBatch(
        mode="extend",
        request_ids=(f"r{slot}",),
        num_decode_seqs=0,
        num_verify_seqs=0,
        input_ids=tuple(tokens),
        seq_lens=(len(tokens),),
        start_positions=(0,),
        kv_pages=(tuple(pages),),
        mamba_slots=(slot,),
        verify_slots=(),
        logits_seqs=(0,),
        prompt_logprob_seqs=(0,),  # every row's logits: rows differ between the two forwards
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * len((f"r{slot}",)),
    )


def test_bf16_logits_are_widened_into_one_reused_buffer(base_model):
    model_dir, _ = base_model
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.bfloat16, "cpu")
    cache = StateCache.for_model(
        config, num_pages=16, page_size=4, num_slots=3, dtype=torch.bfloat16, device="cpu"
    )
    runner = ModelRunner(model, cache, "cpu")
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.clone()))
    gen = torch.Generator().manual_seed(5)
    long = torch.randint(3, config.vocab_size, (11,), generator=gen).tolist()
    short = torch.randint(3, config.vocab_size, (6,), generator=gen).tolist()

    _, first = runner.forward(_prefill(long, 1, [1, 2, 3]))
    first_values, first_ptr = first.clone(), first.data_ptr()
    _, second = runner.forward(_prefill(short, 2, [4, 5]))

    assert captured[0].dtype == torch.bfloat16 and first.dtype == torch.float32
    assert first_values.shape[0] == 11 and second.shape[0] == 6
    torch.testing.assert_close(first_values, captured[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(second, captured[1].float(), rtol=0, atol=0)
    assert second.data_ptr() == first_ptr  # the same storage: no new (rows, vocab) allocation
