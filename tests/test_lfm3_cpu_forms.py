"""The CPU forms of LFM3's layers (engine/layers/cpu_backend.py's pack pass): the attention gate
rides the q/k/v matmul, and a gated MLP runs a long prefill CPU_ROW_CHUNK rows at a time; both
give the unpacked layer's answer (the whole model against transformers: test_window_models.py)."""

from __future__ import annotations

import torch

from baton.engine.layers.mlp import CPU_ROW_CHUNK, GatedMLP
from baton.engine.models.lfm3 import GatedAttention
from baton.kernels.linear import PackedLinear
from tests.test_gdn_models import assert_matches_transformers, prompts_for


def test_gated_attention_packs_its_gate_into_the_qkv_matmul(window_models):
    """After loading on the CPU every gated attention layer has one packed matmul for q, k, v
    and the gate (no g_proj of its own), and its greedy tokens and logprobs are transformers'."""
    from baton import LLM, SamplingParams

    model_dir, hf = window_models("lfm3_mixed")
    llm = LLM(model_dir, dtype="float32", max_running_requests=4)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, GatedAttention)]
    assert layers
    for layer in layers:
        assert layer.g_proj is None
        assert isinstance(layer.qkvg_proj, PackedLinear)
        assert layer.qkvg_proj.out_features == sum(layer.qkv_sizes) + layer.num_heads
    prompt = prompts_for(hf.config.vocab_size)[-1]
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    assert_matches_transformers(hf, prompt, llm.generate([prompt], params)[0])


def test_gated_mlp_runs_a_long_prefill_in_row_chunks_with_the_same_rows(monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, False, "silu")
    rows = 2 * CPU_ROW_CHUNK + 37
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = mlp(x)  # the plain projections, every row at once
        mlp.pack_for_cpu()
        mlp.down_proj = PackedLinear(mlp.down_proj)
        assert mlp.by_rows
        seen = []
        gate_up = mlp.gate_up.forward
        monkeypatch.setattr(mlp.gate_up, "forward", lambda t: seen.append(len(t)) or gate_up(t))
        got = mlp(x)
    assert seen == [CPU_ROW_CHUNK, CPU_ROW_CHUNK, 37]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # a decode step's few rows: one call
        seen.clear()
        mlp(x[:8])
    assert seen == [8]


def test_gated_mlp_under_an_adapter_keeps_its_rows_whole():
    """An adapted projection finds each row's adapter by the row's index in the step: a chunked
    MLP would hand it the wrong rows, so an MLP with one keeps its rows whole."""
    from baton.engine.lora.layer import LoRALinear

    mlp = GatedMLP(64, 96, False, "silu")
    mlp.down_proj = LoRALinear(mlp.down_proj, max_loras=2, max_rank=4, name="down_proj")
    mlp.pack_for_cpu()
    assert mlp.gate_up is not None and not mlp.by_rows
