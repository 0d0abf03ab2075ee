"""Drafters under the tests' control, plugged into an engine that speculates (its scheduler
verifies whatever k drafts they propose), so verification, acceptance and rollback are tested
with every acceptance count, whatever a real drafter would guess."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baton import LLM, SamplingParams


class ScriptedDrafter:
    """Drafts a request's reference continuation (its greedy output without speculation) with
    one token made wrong at a position that moves every step through 0..k, where position k
    means none: verify steps accept every count from 0 to k."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int, vocab_size: int):
        self.reference = reference
        self.k = k
        self.vocab_size = vocab_size
        self.steps = 0

    def _draft(self, req, produced: int) -> tuple[int, ...]:
        ref = self.reference[tuple(req.prompt_ids)]
        follow = ref[produced : produced + self.k]
        follow += [0] * (self.k - len(follow))
        wrong = self.steps % (self.k + 1)
        if wrong < self.k:
            follow[wrong] = (follow[wrong] + 1) % self.vocab_size
        return tuple(follow)

    def propose(self, sched, reqs, sampled) -> dict[int, tuple[int, ...]]:
        self.steps += 1
        return {
            s: self._draft(reqs[s], len(reqs[s].output_ids) + len(tokens.token_ids))
            for s, tokens in sampled.items()
        }

    def propose_from_slots(self, reqs) -> list[tuple[int, ...]]:
        return [self._draft(req, len(req.output_ids)) for req in reqs]


class RandomDrafter:
    """Uniformly random drafts from its own generator (for sampling tests: a draft is accepted
    with the target's probability of it)."""

    def __init__(self, k: int, vocab_size: int, seed: int):
        self.k = k
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def _draft(self) -> tuple[int, ...]:
        return tuple(torch.randint(self.vocab_size, (self.k,), generator=self.generator).tolist())

    def propose(self, sched, reqs, sampled) -> dict[int, tuple[int, ...]]:
        return {s: self._draft() for s in sampled}

    def propose_from_slots(self, reqs) -> list[tuple[int, ...]]:
        return [self._draft() for _ in reqs]


def ngram_config(k: int) -> dict:
    """A speculating engine's config whose drafter the test replaces (n-gram: no MTP head,
    no lookahead pages)."""
    return {"method": "ngram", "num_speculative_tokens": k}


def scripted_llm(model_dir, reference, k: int, **engine_args) -> LLM:
    llm = LLM(model_dir, speculative_config=ngram_config(k), **engine_args)
    llm.engine.drafter = ScriptedDrafter(reference, k, llm.engine.model_config.vocab_size)
    return llm


def greedy_reference(
    model_dir, prompts: Sequence[list[int]], params: SamplingParams, **engine_args
) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy output without speculation (the drafts' source and the oracle)."""
    outputs = LLM(model_dir, **engine_args).generate(list(prompts), params)
    return {tuple(p): out.token_ids for p, out in zip(prompts, outputs)}


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value; bins expecting fewer than 5 counts are pooled."""
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(expected) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat.double() / 2))


def verify_metadata(model, model_dir):
    """Metadata of a verify step (two requests, q = 3 each, from positions 5 and 9) for `model`,
    over a cache whose pools hold random states, and random hidden rows to feed a layer."""
    from baton.engine.cache.pools import StateCache
    from baton.engine.executor.forward_metadata import ScheduledBatch
    from baton.engine.executor.model_runner import ModelRunner

    cache = StateCache.for_model(
        model.config, num_pages=16, page_size=4, num_slots=8, dtype=torch.float32, device="cpu"
    )
    g = torch.Generator().manual_seed(0)
    for pool in cache.pools.values():
        pool.copy_(torch.randn(pool.shape, generator=g))
    sched = ScheduledBatch(
        mode="verify",
        request_ids=("a", "b"),
        num_decode_seqs=0,
        num_verify_seqs=2,
        input_ids=(5, 6, 7, 8, 9, 10),
        seq_lens=(3, 3),
        start_positions=(5, 9),
        kv_pages=((1, 2), (3, 4, 5)),
        mamba_slots=(1, 2),
        verify_slots=((1, 3, 4), (2, 5, 6)),
        logits_seqs=(0, 1),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * len(("a", "b")),
    )
    md = ModelRunner(model, cache, "cpu").build(sched)
    return md, cache, torch.randn(6, model.config.hidden_size, generator=g)


def mtp_prefill_batch(model, tokens: list[int]):
    """A runner over a fresh cache for `model` (built with its MTP head) and an extend batch
    of `tokens` at positions 0.. in pages 1.. (the draft forward's rows, its last one sampled)."""
    from baton.engine.cache.pools import StateCache
    from baton.engine.executor.forward_metadata import ScheduledBatch
    from baton.engine.executor.model_runner import ModelRunner

    cache = StateCache.for_model(
        model.config, num_pages=16, page_size=4, num_slots=4, dtype=torch.float32, device="cpu"
    )
    batch = ScheduledBatch(
        mode="extend",
        request_ids=("r",),
        num_decode_seqs=0,
        num_verify_seqs=0,
        input_ids=tuple(tokens),
        seq_lens=(len(tokens),),
        start_positions=(0,),
        kv_pages=(tuple(range(1, 1 + -(-len(tokens) // 4))),),
        mamba_slots=(1,),
        verify_slots=(),
        logits_seqs=(0,),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * len(("r",)),
    )
    return ModelRunner(model, cache, "cpu"), batch
