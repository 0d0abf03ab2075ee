"""Captured CPU decode steps (engine/executor/cpu_plan.py) on the paths beside the model's own
layers: quantized checkpoints (FP8 and NVFP4 linears and expert stacks on the packed CPU
kernels), structured outputs (the grammar's bitmask applied to the replayed step's logits) and
seeded sampling. Each run captured equals the same engine eager, token for token, and each
proves its steps were replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.engine.quantization.modules import QuantizedLinear
from tests.test_cpu_plan import assert_outputs_match, assert_replayed
from tests.test_structured_engine import PROMPT, SCHEMA, follows, grammar

ASSETS = Path(__file__).parents[1] / "assets"
PROMPTS = [[5, 9, 17, 30, 41], list(range(40, 57)), [7] * 3 + list(range(100, 130))]


@pytest.mark.parametrize(
    ("model", "fmt"),
    [("nemotron_moe", "modelopt_nvfp4"), ("nemotron_moe", "fp8_block"), ("kimi_moe", "fp8_block")],
)
def test_quantized_checkpoint_captured_equals_eager(quantized_models, model, fmt):
    quantized, _ = quantized_models(model, fmt)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(dtype="float32", page_size=4, max_num_batched_tokens=32)
    eager = LLM(quantized, **args, cpu_step_capture=False).generate(PROMPTS, params)
    captured = LLM(quantized, **args)
    assert any(isinstance(m, QuantizedLinear) for m in captured.engine.model.modules())
    assert_outputs_match(captured.generate(PROMPTS, params), eager)
    assert_replayed(captured)


def test_structured_and_seeded_sampling_captured_equal_eager():
    """A JSON schema greedy and sampled (seeded, n = 2) beside a free seeded request: the bitmask
    and the sampler run on the replayed step's logits as on the eager step's."""
    cases = [
        SamplingParams(max_tokens=64, temperature=0, structured_outputs=grammar("json", SCHEMA)),
        SamplingParams(
            max_tokens=40, temperature=1.0, seed=7, n=2, structured_outputs=grammar("json", SCHEMA)
        ),  # fmt: skip
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    ]
    args = dict(dtype="float32", page_size=4)
    eager = LLM(ASSETS, **args, cpu_step_capture=False).generate([PROMPT] * 3, cases)
    captured = LLM(ASSETS, **args)
    got = captured.generate([PROMPT] * 3, cases)  # n = 2: two consecutive outputs
    assert len(got) == 4 and [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert follows(json.loads(got[0].text), SCHEMA)  # the greedy answer kept its grammar
    assert_replayed(captured)
