"""Prompt-lookup drafting (vLLM's "ngram" method) and the speculative config's defaults."""

from __future__ import annotations

import pytest

from baton.engine.spec_decode.config import SpeculativeConfig
from baton.engine.spec_decode.ngram import ngram_drafts


def test_the_longest_recurring_suffix_proposes_what_followed_it_last():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 2, 3]
    # suffix (2, 3) recurs at 1 and 5; the latest (5) was followed by 7, 2, 3
    assert ngram_drafts(tokens, 3, 1, 4) == (7, 2, 3)
    # (1, 2, 3) would need the 1 before the end: only the 2-token suffix recurs
    assert ngram_drafts(tokens, 2, 3, 4) == ()


def test_a_match_near_the_end_is_topped_up_to_k():
    assert ngram_drafts([4, 5, 6, 4, 5], 4, 2, 3) == (6, 4, 5, 5)


def test_nothing_recurs_nothing_is_drafted():
    assert ngram_drafts([1, 2, 3, 4, 5], 3, 1, 3) == ()
    assert ngram_drafts([8], 3, 1, 3) == ()


def test_lookup_bounds_default_as_vllm():
    both = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}, None)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, None
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)


def test_mtp_takes_the_checkpoints_layer_count_as_k_by_default():
    config = SpeculativeConfig.from_dict({"method": "nemotron_h_mtp"}, 1)
    assert (config.method, config.num_speculative_tokens) == ("mtp", 1)
    with pytest.raises(ValueError, match="disable_by_batch_size must be >= 2"):
        SpeculativeConfig.from_dict({"method": "mtp", "disable_by_batch_size": 1}, 1)
