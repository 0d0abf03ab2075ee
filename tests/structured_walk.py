"""Outputs a compiled grammar admits, drawn by walking its matcher: at each step a token the
grammar allows, at random (seeded), leaning towards tokens that close a value so walks end.

What a grammar lets through is what a model may write, whatever its logits: checking the walks'
outputs against the schema checks the grammar, not a model (tests/test_structured_corpus.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import xgrammar as xgr

ASSETS = Path(__file__).parents[1] / "assets"
CLOSERS = ('"', "}", "]", ",", "0", "1", "true", "null", "false")


class Walker:
    """The test tokenizer (assets/, a 494-token byte-level BPE) and a compiler without cache."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(ASSETS))
        self.vocab_size = len(self.tokenizer)
        self.stop = self.tokenizer.eos_token_id
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.stop]
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        texts = [self.tokenizer.decode([i]) for i in range(self.vocab_size)]
        self.closing = torch.tensor([t in CLOSERS for t in texts] + [False] * 32)
        self.closing[self.stop] = True
        self._shifts = torch.arange(32, dtype=torch.int32)

    def walk(self, compiled: xgr.CompiledGrammar, seed: int, max_tokens: int = 12000) -> str | None:
        """One output the grammar admits, or None when the walk did not end in max_tokens."""
        rng = random.Random(seed)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[self.stop])
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        tokens = []
        for step in range(max_tokens):
            if matcher.is_terminated():
                return self.tokenizer.decode(tokens)
            matcher.fill_next_token_bitmask(bitmask)
            allowed = ((bitmask[0].unsqueeze(1) >> self._shifts) & 1).flatten().bool()
            allowed = allowed[: self.vocab_size]
            ids = allowed.nonzero().flatten().tolist()
            assert ids, "the grammar allowed no token (a dead end)"
            closing = (allowed & self.closing[: self.vocab_size]).nonzero().flatten().tolist()
            lean = 0.4 + 0.6 * step / max_tokens
            token = rng.choice(closing if closing and rng.random() < lean else ids)
            assert matcher.accept_token(token)
            if token != self.stop:
                tokens.append(token)
        return None
