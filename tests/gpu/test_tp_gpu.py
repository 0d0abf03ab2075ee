"""Tensor parallelism with CUDA tensors against TP=1: two ranks on one GPU all-reduce over gloo
(NCCL refuses one GPU twice: the single lent GPU runs this case), and two ranks on two GPUs over
NCCL (skipped with fewer than two GPUs: never run here, no machine lent has two).

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_tp_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_tp_engine import ENGINE_ARGS, SHAPES, _assert_same, _prompts
from tests.tiny import save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("name", list(SHAPES))
def test_gloo_tp2_on_one_gpu_matches_tp1(tmp_path, name):
    save_tiny_model(tmp_path, seed=3, tokenizer=False, **SHAPES[name])
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    prompts = _prompts(0, (5, 40, 63, 77))
    args = dict(ENGINE_ARGS, device="cuda", disable_cuda_graph=True)
    with LLM(tmp_path, **args) as tp1:
        expected = tp1.generate(prompts, params)
    with LLM(tmp_path, tensor_parallel_size=2, **args) as tp2:
        _assert_same(expected, tp2.generate(prompts, params))
        assert tp2.stats().num_preemptions > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank (2+ GPUs)")
@pytest.mark.parametrize("name", list(SHAPES))
def test_nccl_tp2_on_two_gpus_matches_tp1(tmp_path, name):
    save_tiny_model(tmp_path, seed=3, tokenizer=False, **SHAPES[name])
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    prompts = _prompts(0, (5, 40, 63, 77))
    args = dict(ENGINE_ARGS, device="cuda", disable_cuda_graph=True)
    with LLM(tmp_path, **args) as tp1:
        expected = tp1.generate(prompts, params)
    with LLM(tmp_path, tensor_parallel_size=2, **args) as tp2:
        assert tp2.engine.ranks.tp.device_group is not None  # the all-reduces ran on NCCL
        _assert_same(expected, tp2.generate(prompts, params))
