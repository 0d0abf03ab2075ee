"""Random sampling with speculation samples the target distribution: the three tokens a tiny
vocabulary model generates, drawn thousands of times with random drafts verified (accepted with
the target's probability of them), fit the exact distribution computed from transformers'
logits; a seeded request even samples the very tokens it samples without speculation."""

from __future__ import annotations

import itertools

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.spec_decode import verifier
from tests.spec_helpers import RandomDrafter, chi_square_p, ngram_config
from tests.tiny import save_tiny_model

VOCAB, PROMPT, NEW = 6, [1, 3, 5, 4], 3


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vocab")
    model = save_tiny_model(path, seed=5, tokenizer=False, vocab_size=VOCAB)
    return path, model


def exact_distribution(model) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) over every sequence of three tokens, (VOCAB ** 3,) float64."""
    probs = torch.zeros([VOCAB] * NEW, dtype=torch.float64)
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW - 1):
            logits = model(torch.tensor([PROMPT + list(seq)])).logits[0, -NEW:].double()
            p = logits.softmax(-1)
            for t3 in range(VOCAB):
                probs[seq + (t3,)] = p[0, seq[0]] * p[1, seq[1]] * p[2, t3]
    return probs.flatten()


def sampled_counts(llm, n: int) -> torch.Tensor:
    params = SamplingParams(max_tokens=NEW, temperature=1.0, ignore_eos=True)
    counts = torch.zeros(VOCAB**NEW, dtype=torch.float64)
    for out in llm.generate([PROMPT] * n, params):
        t1, t2, t3 = out.token_ids
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    return counts


def speculating(model_dir, seed: int) -> LLM:
    llm = LLM(model_dir, seed=seed, max_running_requests=256, speculative_config=ngram_config(2))
    llm.engine.drafter = RandomDrafter(2, VOCAB, seed)
    return llm


def test_speculative_sampling_draws_the_target_distribution(tiny_vocab):
    model_dir, model = tiny_vocab
    llm = speculating(model_dir, seed=11)
    counts = sampled_counts(llm, 1500)  # as many as the test below needs to catch a bad verifier
    stats = llm.stats()
    # drafts were verified at both positions, accepted some of the time and rejected some
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos)
    assert chi_square_p(counts, counts.sum() * exact_distribution(model)) > 1e-3


def test_accepting_every_draft_is_caught(tiny_vocab, monkeypatch):
    """The test above can fail: a verifier that keeps drafts whatever the target says samples
    another distribution."""
    model_dir, model = tiny_vocab
    real = verifier.Sampler.__call__

    def draft_wins(self, logits, contexts, eos_ids, grammar_mask=None):
        result = real(self, logits, contexts, eos_ids, grammar_mask)
        for row, context in enumerate(contexts):
            drafts = getattr(context, "req", context).drafts
            position = len(getattr(context, "pending", ()))
            if position < len(drafts) and row + 1 < len(contexts):
                result.token_ids[row] = drafts[position]
        return result

    monkeypatch.setattr(verifier.Sampler, "__call__", draft_wins)
    counts = sampled_counts(speculating(model_dir, seed=11), 1500)
    assert chi_square_p(counts, counts.sum() * exact_distribution(model)) < 1e-6


def test_seeded_requests_sample_the_same_tokens_with_speculation(tiny_vocab):
    model_dir, _ = tiny_vocab
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True)
        for s in range(12)
    ]
    want = LLM(model_dir).generate([PROMPT] * 12, params)
    llm = speculating(model_dir, seed=3)
    got = llm.generate([PROMPT] * 12, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.stats().spec_decode_num_accepted_tokens > 0
