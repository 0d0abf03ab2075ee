"""LFM3's 1.7B config (tests/fixtures/published_configs/lfm3_1_7b: transformers 5.25's
LFM3-1.7B-style defaults, not a published copy — its SOURCES.md says why), shrunk in sizes only,
built by transformers from that file and run by baton from that same file: greedy tokens and
logprobs must be transformers' (fp32), with the published window of 256 shorter than the
prompt. The same file with `layer_types` and `rope_parameters` left out reads the same (they
are what transformers fills), and keys transformers would misrun are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.published_runs import assert_runs_as_transformers, prompt_ids

FIXTURE = Path(__file__).parent / "fixtures" / "published_configs" / "lfm3_1_7b"
VOCAB, LAYERS = 512, 7  # conv, conv, full, conv, sliding, conv, full
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16,
)  # fmt: skip


def published() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def shrink(raw: dict) -> dict:
    """Sizes replaced; the layer list cut to the first LAYERS; the special ids (pad, bos, ...,
    eos in a run of 8 near the vocabulary's end) moved into the last 8 ids, in their order."""
    out = json.loads(json.dumps(raw))
    out.update(SIZES)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out[key] = VOCAB - 8 + raw[key] - raw["pad_token_id"]
    out["layer_types"] = raw["layer_types"][:LAYERS]
    return out


def test_config_reads_as_transformers_reads_it_with_or_without_the_filled_keys():
    import transformers

    raw = published()
    hf = transformers.Lfm3Config(**raw)
    lfm = ModelConfig.from_dict(raw).family
    assert list(lfm.mixers) == hf.layer_types
    assert (lfm.head_dim, lfm.sliding_window, lfm.intermediate_size) == (
        hf.head_dim, hf.sliding_window, hf.intermediate_size
    )  # fmt: skip
    full = lfm.rope["full_attention"]
    assert (full.rope_type, full.theta, full.partial_rotary_factor) == ("proportional", 1e6, 0.5)
    bare = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    assert ModelConfig.from_dict(bare).family == lfm


@pytest.mark.parametrize(
    "change, key",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
        ({"sliding_window": None}, "sliding_window"),
        (
            {"rope_parameters": {
                "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            }},
            "rope_type",
        ),
    ],
)  # fmt: skip
def test_keys_transformers_would_misrun_are_refused_by_name(change, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(published() | change)


def test_config_runs_as_transformers_runs_it(tmp_path):
    raw = shrink(published())
    assert_runs_as_transformers(
        tmp_path,
        raw,
        "Lfm3ForCausalLM",
        model_seed=9,
        prompts=prompt_ids(3, (6, 300), VOCAB - 8),
        max_tokens=4,
        page_size=16,
        chunked_prefill_size=128,
    )
