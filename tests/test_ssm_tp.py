"""Tensor parallelism for the six families (gloo, two CPU processes): TP=2 gives TP=1's greedy
tokens and logprobs (within 1e-4: the all-reduces sum in another order) through chunked
prefills, preemption (the hybrids) and prefix-cache hits; shapes that cannot split are refused
with a message naming the key; a disaggregated pair across TP sizes (Jamba: prefill TP=2,
decode TP=1) moves each rank's channels of the Mamba1 state and gives the colocated tokens."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.core.engine import Engine
from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.parallel.support import check_tp_supported
from tests.test_disagg_tp import SECRET, _config
from tests.test_tp_engine import _assert_same

# One config per family whose every width splits in two (jamba_moe: experts and a KV head per
# rank; mamba2_a: a group per rank).
SPLITTABLE = ["jamba_moe", "lfm2_a", "lfm2_moe_a", "mamba_a", "falcon_mamba_a", "mamba2_a"]
ENGINE_ARGS = dict(
    page_size=4,
    max_num_batched_tokens=32,
    chunked_prefill_size=16,
    max_total_tokens=112,
    max_mamba_slots=4,
    mamba_track_interval=64,
)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", SPLITTABLE)
def test_tp2_matches_tp1_through_chunks_preemption_and_cache_hits(ssm_models, name):
    model_dir, _ = ssm_models(name)
    tp1 = LLM(model_dir, **ENGINE_ARGS)
    tp2 = LLM(model_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
        first = prompts(0, (5, 70, 40))
        # round 2 shares round 1's prefixes: resumed from checkpoints
        second = [p[:66] + q for p, q in zip(first[1:], prompts(1, (9, 3)))]
        for batch in (first, second):
            _assert_same(tp1.generate(batch, params), tp2.generate(batch, params))
        s1, s2 = tp1.stats(), tp2.stats()
        assert s2.num_preemptions == s1.num_preemptions
        assert s1.num_preemptions > 0 or s1.kv_pages_total == 0  # only page pressure preempts
        assert s2.prefix_cache_hit_tokens == s1.prefix_cache_hit_tokens > 0
        assert s2.kv_pages_used == 0 and s2.mamba_slots_used == 0
    finally:
        tp2.close()


@pytest.mark.parametrize(
    "name,size,key",
    [
        ("jamba_dense", 2, "num_attention_heads=5"),
        ("lfm2_moe_nobias", 3, "hidden_size=32"),
        ("mamba2_b", 2, "num_heads=5"),
        ("falcon_mamba_b", 5, r"intermediate_size \(expand x hidden_size\)=48"),
    ],
)
def test_shapes_that_cannot_split_are_refused_naming_the_key(ssm_models, name, size, key):
    model_dir, _ = ssm_models(name)
    with pytest.raises(ConfigError, match=key):  # what the engine checks before any rank starts
        check_tp_supported(ModelConfig.from_hf(model_dir), size)
    if name == "jamba_dense":
        with pytest.raises(ConfigError, match=key):
            Engine(model_dir, tensor_parallel_size=size)


def test_jamba_pd_from_tp2_prefill_to_tp1_decode_matches_colocated(ssm_models, monkeypatch):
    model_dir, _ = ssm_models("jamba_moe")
    monkeypatch.setenv(SECRET_ENV, SECRET)  # every rank's connector (the ranks inherit it)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    batch = prompts(3, (5, 70, 33))
    colocated = Engine(model_dir, **ENGINE_ARGS)
    expected: dict[str, list[int]] = {}
    for i, p in enumerate(batch):
        colocated.add_request(f"r{i}", p, params)
    while colocated.has_unfinished_requests():
        for d in colocated.step():
            expected.setdefault(d.request_id, []).extend(d.new_token_ids)
    context = zmq.Context()
    sides = {}
    for role, size in (("prefill", 2), ("decode", 1)):
        engine = Engine(
            model_dir,
            tensor_parallel_size=size,
            handover_connector=connector_spec(role, "127.0.0.1"),
            **ENGINE_ARGS,
        )
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        sides[role] = cls(engine, _config(role), context)
    prefill, decoder = sides["prefill"], sides["decode"]
    try:
        got: dict[str, list[int]] = {}
        for i, prompt in enumerate(batch):
            decoder.add_request(f"r{i}", prompt, params, room=f"j{i}", prefill_addr=prefill.address)
            prefill.add_request(f"r{i}", prompt, params, room=f"j{i}")
        start = time.time()
        while decoder.has_unfinished_requests() or prefill.has_unfinished_requests():
            assert time.time() - start < 120, "the pair did not finish"
            prefill.step()
            for delta in decoder.step():
                got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        assert got == expected
        assert prefill.take_failures() == [] and decoder.take_failures() == []
        assert sum(decoder.engine.handover.shards.bytes_received) > 0  # rank to rank
    finally:
        for worker in (prefill, decoder):
            worker.close()
            worker.engine.close()
