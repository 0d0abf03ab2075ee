"""Turn logits into tokens: logit bias, penalties, greedy / temperature, top-k, top-p, min-p, seeds, logprobs.

Random rows use the exponential-race form of Gumbel-max (argmax p / q, q ~ Exp(1)), which needs
no cumulative sums and no host sync. A request with a seed draws its noise from its own
generator, so its tokens do not depend on the batch around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from baton.engine.core.outputs import TokenLogprobs
from baton.engine.core.request import Request
from baton.kernels.cpu.ops import argmax_rows


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None when the request asked for none


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """logprobs: (rows, vocab); chosen: (rows,). One dict per row: top-k plus the chosen token."""
    out: list[TokenLogprobs] = []
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
    for row, token in enumerate(chosen.tolist()):
        entry = dict(zip(indices[row], values[row])) if k > 0 else {}
        entry[token] = chosen_lp[row]
        out.append(entry)
    return out


# Prompt logprobs are computed over this many rows of a chunk's logits at a time.
PROMPT_LOGPROB_ROWS = 256


def prompt_logprobs_of(
    req: Request, start: int, logits: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Row i of `logits` (position start + i) predicts the prompt token at start + i + 1; the
    first prompt token has none (None)."""
    out: list[TokenLogprobs | None] = [None] if start == 0 else []
    targets = req.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    # a few rows at a time: a chunk's (rows, vocab) log-softmax whole would be another copy
    # of its logits (1 GB for 2048 rows of a 128k vocabulary)
    for first in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        block = targets[first : first + PROMPT_LOGPROB_ROWS]
        logprobs = logits[first : first + len(block)].log_softmax(dim=-1)
        out.extend(top_logprobs(logprobs, torch.tensor(block), req.params.prompt_logprobs))
    return out


def apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Each request's logit_bias added to its row (OpenAI / vLLM semantics)."""
    for row, req in enumerate(reqs):
        bias = req.params.logit_bias
        if not bias:
            continue
        if req.logit_bias_rows is None:
            req.logit_bias_rows = (
                torch.tensor(list(bias), dtype=torch.int64, device=logits.device),
                torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device),
            )
        ids, values = req.logit_bias_rows
        logits[row].index_add_(0, ids, values)
    return logits


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Presence / frequency penalties over generated tokens, repetition penalty over prompt and
    generated tokens (vLLM / OpenAI semantics)."""
    for row, req in enumerate(reqs):
        p = req.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.int64, device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if req.output_ids and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(req.output_ids, device=logits.device).unique(
                return_counts=True
            )
            logits[row, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on random rows; returns probabilities."""
    temps = torch.tensor(
        [r.params.temperature for r in reqs], dtype=logits.dtype, device=logits.device
    )
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in reqs]
    if any(k < vocab for k in top_k):
        k = torch.tensor(top_k, device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = logits.softmax(dim=-1)
    top_p = [r.params.top_p for r in reqs]
    if any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop = before > torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    min_p = [r.params.min_p for r in reqs]
    if any(m > 0.0 for m in min_p):
        floor = (
            probs.max(dim=-1, keepdim=True).values
            * torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]
        )
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


class Sampler:
    def __init__(self, seed: int, device: torch.device | str):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        eos_ids: tuple[int, ...],
        grammar_mask: Callable[[torch.Tensor], None] | None = None,
    ) -> SampleResult:
        """logits: (rows, vocab) float32, one row per request in `reqs`. `grammar_mask`
        (structured outputs) sets the tokens its grammars forbid to -inf in place, after the
        logprobs were taken: they are the model's (issue 36 asks so; vLLM 0.32 masks first and
        returns logprobs renormalised over the allowed tokens)."""
        raw_logprobs = (
            logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in reqs) else None
        )
        edited = any(
            r.params.has_penalties or r.params.logit_bias or len(r.output_ids) < r.params.min_tokens
            for r in reqs
        )
        if edited:
            logits = logits.clone()  # the raw logits stay untouched for logprobs
            apply_logit_bias(logits, reqs)
            apply_penalties(logits, reqs)
        if grammar_mask is not None:
            grammar_mask(logits)
        if edited:
            self._mask_early_stops(logits, reqs, eos_ids)
        tokens = argmax_rows(logits)  # greedy rows (random rows are redrawn below)
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            sub = [reqs[i] for i in random_rows]
            probs = filter_logits(logits[random_rows], sub)
            noise = torch.empty_like(probs)
            for j, req in enumerate(sub):  # skip_seeded_draws below mirrors this draw
                noise[j].exponential_(generator=req.generator or self.generator)
            tokens[random_rows] = (probs / noise).argmax(dim=-1)
        logprob_rows: list[TokenLogprobs | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
            k = max(reqs[i].params.logprobs for i in wanted)
            entries = top_logprobs(raw_logprobs[wanted], tokens[wanted], k)
            for i, entry in zip(wanted, entries):
                keep = reqs[i].params.logprobs
                if keep < k:  # trim to this request's top-k, keeping the chosen token
                    chosen = int(tokens[i])
                    best = sorted(entry.items(), key=lambda kv: -kv[1])[:keep]
                    entry = dict(best) | {chosen: entry[chosen]}
                logprob_rows[i] = entry
        return SampleResult(token_ids=tokens.tolist(), logprobs=logprob_rows)

    @staticmethod
    def skip_seeded_draws(req: Request, tokens: int, vocab_size: int) -> None:
        """Advance a seeded sampling request's generator past the noise of `tokens` tokens
        sampled elsewhere (the first token, on a disaggregated prefill engine), so that it goes
        on drawing exactly what one engine would have drawn: seeded output stays the same with
        or without disaggregation. One draw per token: a float32 row of the vocabulary."""
        if req.generator is None or req.params.greedy:
            return
        row = torch.empty(vocab_size, dtype=torch.float32, device=req.generator.device)
        for _ in range(tokens):
            row.exponential_(generator=req.generator)

    @staticmethod
    def _mask_early_stops(
        logits: torch.Tensor, reqs: Sequence[Request], eos_ids: tuple[int, ...]
    ) -> None:
        for row, req in enumerate(reqs):
            if len(req.output_ids) < req.params.min_tokens:
                banned = list(req.params.stop_token_ids) + (
                    [] if req.params.ignore_eos else list(eos_ids)
                )
                if banned:
                    kept = logits[row, banned]
                    logits[row, banned] = -torch.inf
                    if not torch.isfinite(logits[row]).any():
                        # a grammar that allows nothing but its end: the grammar wins
                        logits[row, banned] = kept
