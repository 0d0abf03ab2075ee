"""Returning conversations for the tier tests (tests/test_hicache*.py): pools that hold about two
conversations of ~250 tokens, ten conversations, each coming back for a second turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams

INTERVAL = 64  # a multiple of every family's chunk (16 or 64) and of the page (4)
# ~2 conversations of 250 tokens in the KV pool; a slot per cached block plus working slots
POOLS = dict(page_size=4, mamba_track_interval=INTERVAL, max_total_tokens=600, max_mamba_slots=12)
FAMILIES = ("nemotron_h", "qwen3_5_dense", "jamba_dense", "mamba_a", "rgemma_local")


def family_model(request: pytest.FixtureRequest, family: str) -> tuple[Path, int]:
    """(model dir, vocab size) of a tiny random model, built once per session."""
    if family == "nemotron_h":
        path, hf = request.getfixturevalue("tiny_models")("base")
    elif family.startswith("qwen"):
        path, hf = request.getfixturevalue("gdn_models")(family)
    elif family.startswith(("rgemma", "lfm3")):
        path, hf = request.getfixturevalue("window_models")(family)
    else:
        path, hf = request.getfixturevalue("ssm_models")(family)
    config = getattr(hf.config, "text_config", hf.config)
    return Path(path), config.vocab_size


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)


def conversations(vocab: int, n: int = 10, length: int = 250, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def tiered(store: Path, **extra) -> dict:
    return dict(
        POOLS,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(store),
        **extra,
    )


def file_hits(llm: LLM) -> int:
    return llm.engine.tier_stats().get("hicache:file:hits", 0)


def one_by_one(llm: LLM, prompts: list[list[int]], max_tokens: int = 4) -> tuple[list, list[int]]:
    """Each prompt alone, in order (so the pools turn over); its output and how many blocks it
    restored from the file tier."""
    outs, hits = [], []
    for prompt in prompts:
        before = file_hits(llm)
        outs += llm.generate([prompt], greedy(max_tokens))
        hits.append(file_hits(llm) - before)
    return outs, hits


def first_turns(llm: LLM, convs: list[list[int]], max_tokens: int = 4) -> list[list[int]]:
    """Run every first turn; the second-turn prompts (history + answer + a new question)."""
    outs, _ = one_by_one(llm, convs, max_tokens)
    g = torch.Generator().manual_seed(99)
    return [
        c + o.token_ids + torch.randint(3, 200, (10,), generator=g).tolist()
        for c, o in zip(convs, outs)
    ]


def without_prefix_cache(model_dir: Path, prompts: list[list[int]]) -> list:
    with LLM(model_dir, page_size=4, enable_prefix_caching=False) as off:
        return off.generate(prompts, greedy())


def block_files(store: Path) -> list[Path]:
    return sorted(store.glob("*.blk"))
