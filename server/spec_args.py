"""Speculative decoding's flags, vLLM's spelling with SGLang's as aliases, for `baton serve` and
`baton up` alike (engine/spec_decode/config.py reads and checks the dict they make)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from baton.engine.spec_decode.config import from_sglang, parse_speculative_config

SGLANG_FLAGS = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "speculative decoding", "vLLM's --speculative-config, or SGLang's flags"
    )
    group.add_argument(
        "--speculative-config",
        help='JSON, as vLLM\'s: {"method": "mtp" (the checkpoint\'s MTP layers) or "ngram" '
        '(prompt lookup), "num_speculative_tokens": k, "prompt_lookup_max", '
        '"prompt_lookup_min", "disable_by_batch_size"}',
    )
    group.add_argument(
        "--speculative-algorithm",
        help="SGLang's: NEXTN (or EAGLE) drafts with the checkpoint's MTP layers",
    )
    group.add_argument("--speculative-num-steps", type=int, help="SGLang's: drafts per step (k)")
    group.add_argument("--speculative-eagle-topk", type=int, help="SGLang's: 1 (one draft chain)")
    group.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        help="SGLang's: tokens verified per step, k + 1",
    )


def speculative_dict(
    config: str | None,
    algorithm: str | None,
    num_steps: int | None,
    eagle_topk: int | None,
    num_draft_tokens: int | None,
) -> dict[str, Any] | None:
    """The vLLM-style dict the flags ask for (None: no speculation); ValueError naming the flag
    when they contradict each other."""
    sglang = {
        "--speculative-num-steps": num_steps,
        "--speculative-eagle-topk": eagle_topk,
        "--speculative-num-draft-tokens": num_draft_tokens,
    }
    if config is not None and algorithm is not None:
        raise ValueError("pass --speculative-config or --speculative-algorithm, not both")
    if config is not None:
        return parse_speculative_config(config)
    if algorithm is not None:
        return from_sglang(algorithm, num_steps, eagle_topk, num_draft_tokens)
    given = [flag for flag, value in sglang.items() if value is not None]
    if given:
        raise ValueError(f"{given[0]} needs --speculative-algorithm")
    return None


def speculative_flag(raw: dict[str, Any] | None) -> list[str]:
    """What hands the same setting to a worker process: one --speculative-config."""
    return ["--speculative-config", json.dumps(raw)] if raw is not None else []
