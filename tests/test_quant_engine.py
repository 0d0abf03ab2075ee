"""A quantized checkpoint (ModelOpt mixed precision: NVFP4 experts, FP8 and NVFP4 linears, the
rest bf16) through the serving paths that hold no quantization code: tensor parallelism (each
rank loads its slice of codes and scales), a disaggregated prefill/decode pair, and the prefix
cache, each against colocated TP=1 on the same checkpoint; and the GPU pool sizing, which gives the
pools what the weights leave as stored (NVFP4), not as dequantized."""

from __future__ import annotations

import pytest
import torch
import zmq
from safetensors import safe_open

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.models.registry import model_state_spec
from tests.test_disagg_unit import assert_pools_empty, colocated_tokens, config, run_pair

# small pools (preemption), checkpoints every 16 tokens (prefix hits), 16-token chunks
ENGINE_ARGS = dict(
    dtype="float32",
    page_size=4,
    max_num_batched_tokens=32,
    chunked_prefill_size=16,
    max_total_tokens=112,
    max_mamba_slots=4,
    mamba_track_interval=16,
)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


def assert_same(outs_1, outs_2, tolerance: float) -> None:
    for one, two in zip(outs_1, outs_2, strict=True):
        assert two.token_ids == one.token_ids
        for lp_1, lp_2 in zip(one.logprobs, two.logprobs, strict=True):
            assert lp_2.keys() == lp_1.keys()
            assert all(abs(lp_2[t] - v) <= tolerance for t, v in lp_1.items())


@pytest.fixture(scope="module")
def mixed(quantized_models):
    return quantized_models("nemotron_moe", "modelopt_mixed")[0]


def test_tp2_matches_tp1_on_a_quantized_checkpoint(mixed):
    """Rank 1 holds its rows / inputs of every quantized weight and its scales (experts' NVFP4
    groups of 16 whole, per-tensor FP8 scales on both ranks)."""
    first = prompts(0, (5, 40, 63))
    second = [p[:32] + q for p, q in zip(first[1:], prompts(1, (9, 20)))]  # prefix-cache hits
    tp1 = LLM(mixed, **ENGINE_ARGS)
    tp2 = LLM(mixed, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        for batch in (first, second):
            assert_same(tp1.generate(batch, PARAMS), tp2.generate(batch, PARAMS), 1e-4)
        assert tp2.stats().prefix_cache_hit_tokens == tp1.stats().prefix_cache_hit_tokens > 0
        assert tp2.stats().kv_pages_used == 0 and tp2.stats().mamba_slots_used == 0
    finally:
        tp2.close()


def test_prefix_cache_on_equals_off_on_a_quantized_checkpoint(mixed):
    on = LLM(mixed, **ENGINE_ARGS)
    off = LLM(mixed, enable_prefix_caching=False, **ENGINE_ARGS)
    shared = prompts(2, (40,))[0]
    batch = [shared + tail for tail in prompts(3, (3, 11, 6))]
    for _ in range(2):  # the second round resumes from the first's checkpoints
        assert_same(off.generate(batch, PARAMS), on.generate(batch, PARAMS), 1e-4)
    assert on.stats().prefix_cache_hit_tokens > 0


def test_disaggregated_pair_equals_colocated_on_a_quantized_checkpoint(mixed):
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batch = prompts(4, (1, 6, 45))
    expect = colocated_tokens(Engine(mixed, page_size=4), batch, params)
    prefill = PrefillWorker(
        Engine(mixed, page_size=4, chunked_prefill_size=16), config("prefill"), ctx
    )
    decoder = DecodeWorker(Engine(mixed, page_size=4), config("decode"), ctx)
    try:
        assert run_pair(prefill, decoder, batch, params) == expect
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()


class PoolsSized(Exception):
    """Raised in place of sizing the pools: the engine's budgets, before any weight loads."""


def gpu_pool_budget(model_dir, monkeypatch, free: int) -> tuple[int, int]:
    """(tokens, slots) an engine on a GPU with `free` bytes free gives its pools (nothing is
    loaded: the engine stops where it would size them)."""

    def stop(**sizes):
        raise PoolsSized(sizes["max_total_tokens"], sizes["max_mamba_slots"])

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    monkeypatch.setattr("baton.engine.core.engine.size_pools", stop)
    with pytest.raises(PoolsSized) as sized:
        Engine(model_dir, dtype="float32", device="cuda", max_mamba_slots=4, mem_fraction=1.0)
    return sized.value.args


def loaded_bytes(model_dir) -> int:
    """What the weights take in float32: quantized codes and their scales as stored, every
    other tensor widened to 4 bytes a value; scales baton does not apply are not loaded."""
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if name.endswith(("input_scale", "k_scale", "v_scale")):
                continue
            quantized = tensor.dtype in (torch.float8_e4m3fn, torch.uint8) or "weight_scale" in name
            total += tensor.nbytes if quantized else tensor.numel() * 4
    return total


def test_gpu_pools_get_the_memory_the_quantized_weights_leave(quantized_models, monkeypatch):
    """On a GPU the pools are sized before loading, from the free memory less what the weights
    will take: an NVFP4 checkpoint's codes and scales as stored, not its dequantized size."""
    quantized, dequantized = quantized_models("nemotron_moe", "modelopt_nvfp4")
    spec = model_state_spec(ModelConfig.from_hf(quantized), torch.float32)
    token_bytes, slot_bytes = spec.bytes_per_token(), spec.bytes_per_slot()
    pools = 4 * slot_bytes + 500 * token_bytes  # the memory left once the weights are in
    for model_dir in (quantized, dequantized):
        weights = loaded_bytes(model_dir)
        tokens, slots = gpu_pool_budget(model_dir, monkeypatch, free=weights + pools)
        assert (tokens, slots) == (500, 4), model_dir.name
    assert loaded_bytes(quantized) < 0.5 * loaded_bytes(dequantized)


def test_weights_larger_than_the_free_gpu_memory_are_refused_before_loading(
    quantized_models, monkeypatch
):
    quantized, _ = quantized_models("nemotron_moe", "modelopt_nvfp4")
    with pytest.raises(ValueError, match=r"the weights take about .* free on cuda"):
        gpu_pool_budget(quantized, monkeypatch, free=loaded_bytes(quantized) // 2)
