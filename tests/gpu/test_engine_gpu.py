"""The whole engine on a CUDA device (compiled Triton kernels, CUDA-graph decode) against
transformers on the CPU, on the tiny float32 model the CPU suite uses.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_engine_gpu.py

float32 serving keeps `tl.dot` in IEEE float32 (baton.kernels.backend.dot_precision), so the CPU
suite's bar holds here too: greedy tokens identical up to a reference near-tie and logprobs
within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.reference import hf_greedy
from tests.test_engine import check_against_reference, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ENGINE_ARGS = dict(
    device="cuda",
    page_size=4,
    max_num_batched_tokens=96,
    chunked_prefill_size=40,
    max_running_requests=32,
)


@pytest.fixture(scope="module")
def references(base_model):
    _, hf = base_model
    prompts, max_tokens = workload(hf.config.vocab_size)
    return prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


def greedy(max_tokens):
    return [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in max_tokens
    ]


def test_cuda_engine_with_graphs_matches_transformers(base_model, references):
    model_dir, _ = base_model
    prompts, max_tokens, refs = references
    llm = LLM(model_dir, **ENGINE_ARGS)
    runner = llm.engine.graph_runner
    assert runner is not None and runner.use_cuda_graphs
    modes, replays = [], []
    original_forward = llm.engine.runner.forward
    llm.engine.runner.forward = lambda sched: (modes.append(sched.mode), original_forward(sched))[1]
    original_graph = runner.forward
    runner.forward = lambda sched: (replays.append(sched.num_decode_seqs), original_graph(sched))[1]
    outs = llm.generate(prompts, greedy(max_tokens))
    assert {"mixed"} <= set(modes), modes  # mixed batches ran eagerly
    assert replays and runner.graphs, "no decode step ran through a CUDA graph"
    check_against_reference(outs, prompts, refs)
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_cuda_graphs_equal_eager_and_prefix_cache_equals_no_cache(base_model):
    """Shared prefixes longer than the track interval: the prefix cache really hits, and the
    tokens and logprobs equal those of an engine without the cache and without graphs."""
    model_dir, hf = base_model
    g = torch.Generator().manual_seed(3)
    stem = torch.randint(3, hf.config.vocab_size, (150,), generator=g).tolist()
    prompts = [
        stem + torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
        for n in (1, 7, 33, 64, 5, 90)
    ]
    params = greedy([24] * len(prompts))
    plain = LLM(model_dir, **ENGINE_ARGS, disable_cuda_graph=True, enable_prefix_caching=False)
    reference = plain.generate(prompts, params)
    cached = LLM(model_dir, **ENGINE_ARGS, enable_prefix_caching=True, mamba_track_interval=32)
    cached.generate(prompts[:1], params[:1])  # warm the cache with the shared stem
    outs = cached.generate(prompts, params)
    assert cached.engine.prefix_cache.stats.hit_tokens > 0
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs, ref.logprobs):
            for token, lp in theirs.items():
                assert abs(mine[token] - lp) < 1e-4


def test_cuda_graph_verify_steps_keep_greedy_outputs(tiny_models, tmp_path):
    """MTP speculation (k = 2) with verify steps replayed from CUDA graphs gives the tokens and
    logprobs of plain eager decoding; the verify graphs were really captured and replayed."""
    from tests.mtp_models import add_mtp_layer

    source_dir, hf = tiny_models("moe_nano")
    model_dir = tmp_path / "model"
    add_mtp_layer(source_dir, model_dir, ["full_attention", "moe"])
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (9, 30, 17)
    ]
    params = greedy([20] * len(prompts))
    plain = LLM(model_dir, **ENGINE_ARGS, disable_cuda_graph=True)
    reference = plain.generate(prompts, params)
    spec = LLM(
        model_dir, **ENGINE_ARGS, speculative_config={"method": "mtp", "num_speculative_tokens": 2}
    )
    outs = spec.generate(prompts, params)
    assert any(key[0] == "verify" for key in spec.engine.graph_runner.graphs)
    assert spec.stats().spec_decode_num_drafts > 0
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs, ref.logprobs):
            for token, lp in theirs.items():
                assert abs(mine[token] - lp) < 1e-4
