"""The whole engine on the Triton kernels (interpreter on CPU) against the torch path."""

from __future__ import annotations

import pytest
import torch

import baton.kernels.triton.attention
import baton.kernels.triton.conv1d
import baton.kernels.triton.norm
import baton.kernels.triton.ssd
import baton.kernels.triton.ssu
from baton import LLM, SamplingParams

LAUNCHERS = [
    (baton.kernels.triton.ssd, "ssd_scan_triton"),
    (baton.kernels.triton.conv1d, "causal_conv1d_varlen_triton"),
    (baton.kernels.triton.conv1d, "causal_conv1d_update_triton"),
    (baton.kernels.triton.ssu, "selective_state_update_triton"),
    (baton.kernels.triton.attention, "paged_attention_triton"),
]


@pytest.fixture
def launches(monkeypatch):
    counts: dict[str, int] = {}
    for module, name in LAUNCHERS:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


def test_triton_engine_matches_torch_engine(base_model, monkeypatch, launches):
    model_dir, hf = base_model
    g = torch.Generator().manual_seed(12)
    prompts = [
        torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 23)
    ]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(
        page_size=16,
        chunked_prefill_size=16,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    monkeypatch.setenv("BATON_KERNELS", "torch")
    reference = LLM(model_dir, **args).generate(prompts, params)
    assert not launches
    monkeypatch.setenv("BATON_KERNELS", "triton")
    outs = LLM(model_dir, **args).generate(prompts, params)
    assert set(launches) == {name for _, name in LAUNCHERS}, launches  # every kernel really ran
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs, ref.logprobs):
            for token, lp in theirs.items():
                assert abs(mine[token] - lp) < 1e-3
