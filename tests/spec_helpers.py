"""Drafters under the tests' control, plugged into an engine that speculates (its scheduler
verifies whatever k drafts they propose), so verification, acceptance and rollback are tested
with every acceptance count, whatever a real drafter would guess."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import LLM, SamplingParams


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
