"""The gated DeltaNet families on a CUDA device (compiled Triton kernels: the chunked rule, the
decode step, the conv; CUDA-graph decode through the one metadata builder) against transformers
on the CPU, on the tiny float32 models the CPU suite builds (tests/gdn_families.py).

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_gdn_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_gdn_models import assert_matches_transformers, prompts_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ENGINE_ARGS = dict(device="cuda", page_size=4, chunked_prefill_size=16, max_num_batched_tokens=32)
NAMES = ["qwen3_next_moe", "qwen3_5_vision", "olmo_hybrid_nope"]  # one per projection layout


@pytest.mark.parametrize("name", NAMES)
def test_cuda_engine_with_graphs_matches_transformers(gdn_models, name):
    model_dir, hf = gdn_models(name)
    prompts = prompts_for(hf.config.get_text_config().vocab_size)
    llm = LLM(model_dir, **ENGINE_ARGS)
    runner = llm.engine.graph_runner
    assert runner is not None and runner.use_cuda_graphs
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outs = llm.generate(prompts, params)
    assert runner.graphs, "no decode step ran through a CUDA graph"
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out)


@pytest.mark.parametrize("name", NAMES)
def test_cuda_graphs_with_prefix_cache_equal_eager_without(gdn_models, name):
    """Decode checkpoints captured in the graphs: a prefix hit resumes from them and gives the
    tokens and logprobs of an eager engine without the cache."""
    model_dir, hf = gdn_models(name)
    vocab = hf.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(3)
    stem = torch.randint(3, vocab, (70,), generator=g).tolist()
    prompts = [stem + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 33, 64)]
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True, logprobs=1)
    plain = LLM(model_dir, **ENGINE_ARGS, disable_cuda_graph=True, enable_prefix_caching=False)
    reference = plain.generate(prompts, params)
    cached = LLM(model_dir, **ENGINE_ARGS, mamba_track_interval=64)
    cached.generate(prompts[:1], params)  # its decode crosses position 128: a decode checkpoint
    outs = cached.generate(prompts, params)
    assert cached.engine.prefix_cache.stats.hit_tokens > 0
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs, ref.logprobs):
            for token, lp in theirs.items():
                assert abs(mine[token] - lp) < 1e-4
