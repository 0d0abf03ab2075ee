"""What `--speculative-config` asks for, read and checked at the boundary as vLLM reads it.

    --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    SGLang:  --speculative-algorithm NEXTN --speculative-num-steps 2
             --speculative-eagle-topk 1 --speculative-num-draft-tokens 3

`method`: "mtp" drafts with the checkpoint's multi-token-prediction layers, chained for k tokens
(vLLM's "deepseek_mtp" / "nemotron_h_mtp" / "qwen3_next_mtp" name the same thing); "ngram" drafts
by prompt lookup, for every family. `disable_by_batch_size`: no drafts while that many requests
(or more) are in the engine, running or waiting (vLLM counts the running ones; counting the
queue too keeps a burst from speculating while it fills the batch): a full batch gains nothing
from verifying guesses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

SpecMethod = Literal["mtp", "ngram"]
# vLLM's spellings of the checkpoint's own MTP layers.
MTP_ALIASES = ("mtp", "deepseek_mtp", "nemotron_h_mtp", "qwen3_next_mtp", "qwen3_5_mtp")
KNOWN_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
)
MAX_SPECULATIVE_TOKENS = 16  # a verify step feeds k + 1 tokens per request
NGRAM_DEFAULT_LOOKUP = 5  # vLLM's, when neither bound is given


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int  # k: drafts verified per step
    prompt_lookup_max: int  # ngram: the longest suffix looked up in the sequence
    prompt_lookup_min: int  # ngram: the shortest one
    disable_by_batch_size: int | None  # no drafts while this many requests are in (None: never)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], num_nextn_predict_layers: int | None
    ) -> SpeculativeConfig:
        """vLLM's keys; `num_nextn_predict_layers` (the checkpoint's) is MTP's default k.
        ValueError naming the key for anything baton cannot honour."""
        unknown = sorted(set(raw) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(
                f"--speculative-config: unsupported key(s) {unknown} (baton takes {list(KNOWN_KEYS)})"
            )
        method = raw.get("method")
        if method in MTP_ALIASES:
            method = "mtp"
        elif method in ("ngram", "[ngram]"):
            method = "ngram"
        else:
            raise ValueError(
                f"--speculative-config: method {method!r} is not supported (baton runs 'mtp' and"
                " 'ngram')"
            )
        if raw.get("model") is not None and method == "ngram":
            raise ValueError("--speculative-config: 'model' has no meaning for method 'ngram'")
        if method == "mtp" and raw.get("model") is not None:
            # vLLM's MTP reads the target's own checkpoint; a separate draft model is another method.
            raise ValueError(
                "--speculative-config: method 'mtp' drafts with the served checkpoint's own MTP"
                " layers; a separate draft 'model' is not supported"
            )
        k = raw.get("num_speculative_tokens")
        if k is None and method == "mtp":
            k = num_nextn_predict_layers or None
        if k is None:
            raise ValueError(
                f"--speculative-config: method {method!r} needs num_speculative_tokens"
            )
        _check_int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = NGRAM_DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        _check_int("prompt_lookup_min", low, 1, None)
        _check_int("prompt_lookup_max", high, 1, None)
        if low > high:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({low}) must be <= prompt_lookup_max"
                f" ({high})"
            )
        disable = raw.get("disable_by_batch_size")
        if disable is not None:
            _check_int("disable_by_batch_size", disable, 2, None)
        return cls(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_max=high,
            prompt_lookup_min=low,
            disable_by_batch_size=disable,
        )

    @classmethod
    def check_flags(cls, raw: dict[str, Any]) -> None:
        """Every key and value the flags give, checked where the checkpoint is not read: the
        server and `baton up` keep torch out of their processes, and reading a family's config
        imports its module (and torch). The checkpoint's part, MTP layers for method "mtp" and
        MTP's default k, is checked by the engine at load (`for_checkpoint`), whose refusal the
        server reports as a startup failure; 1 MTP layer stands in for it here."""
        cls.from_dict(raw, num_nextn_predict_layers=1)

    @classmethod
    def for_checkpoint(
        cls, raw: dict[str, Any], num_nextn_predict_layers: int
    ) -> SpeculativeConfig:
        """`from_dict`, and method "mtp" refused for a checkpoint without MTP layers."""
        config = cls.from_dict(raw, num_nextn_predict_layers)
        if config.method == "mtp" and not num_nextn_predict_layers:
            raise ValueError(
                "speculative method 'mtp' needs the checkpoint's MTP layers, and its config.json"
                " has num_nextn_predict_layers = 0 (method 'ngram' needs none)"
            )
        return config

    def to_dict(self) -> dict[str, Any]:
        """The vLLM form (what the CLI hands an engine process)."""
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
            "disable_by_batch_size": self.disable_by_batch_size,
        }


def _check_int(key: str, value: Any, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"--speculative-config: {key} must be {bound}, got {value}")


def parse_speculative_config(text: str) -> dict[str, Any]:
    """The flag's JSON text -> a dict (ValueError with the flag's name when it is not an object)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return raw


def from_sglang(
    algorithm: str, num_steps: int | None, eagle_topk: int | None, num_draft_tokens: int | None
) -> dict[str, Any]:
    """SGLang's flags as vLLM's dict: NEXTN (and EAGLE, its alias for MTP checkpoints) with one
    chain (topk 1) of num_steps drafts, verified as num_steps + 1 tokens."""
    if algorithm.upper() not in ("NEXTN", "EAGLE"):
        raise ValueError(
            f"--speculative-algorithm {algorithm!r} is not supported (baton runs NEXTN / EAGLE"
            " with the checkpoint's MTP layers)"
        )
    if eagle_topk not in (None, 1):
        raise ValueError(
            f"--speculative-eagle-topk {eagle_topk}: baton drafts one chain (topk 1) only"
        )
    if num_steps is None and num_draft_tokens is not None:
        num_steps = num_draft_tokens - 1
    if num_steps is not None and num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} must be --speculative-num-steps"
            f" + 1 = {num_steps + 1} with topk 1"
        )
    raw: dict[str, Any] = {"method": "mtp"}
    if num_steps is not None:
        raw["num_speculative_tokens"] = num_steps
    return raw
