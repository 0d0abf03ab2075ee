"""Kimi Linear on the serving paths that follow the state spec (nothing in the pools, prefix cache,
handover, wire or TP planning names KDA or MLA):

    MLA's latent pages     one latent row (kv_lora_rank + qk_rope_head_dim) a token and layer in
                           a pool of its own, no per-head K/V pool: the published 48B's bytes a
                           token, measured from its state spec
    prefix cache on        == off, with hits resumed from KDA checkpoints and latent pages
                           (decode steps through the padded runner: padding rows on the dummy
                           slot and page)
    PD pair                == colocated, TP 1 -> 1 and 2 -> 1, twice: the second round's prompts
                           extend the first's, so both workers resume from their caches
    colocated TP = 2       == TP = 1 (KDA and MLA heads split, the latent replicated)
    speculative verify     == plain decoding at every acceptance count

MiniMax (lightning attention's (heads, dk, dv) slot state beside softmax K/V pages) on the same
paths but the latent's: prefix cache, PD, TP = 2 (lightning heads and its whole-width output
norm, softmax heads, experts' intermediate split) and speculative verify.

Greedy, fp32; tokens and their logprobs compared (1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zmq

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.models.registry import model_state_spec
from tests.same_outputs import assert_same_outputs
from tests.spec_helpers import scripted_llm
from tests.test_gdn_serving import (
    ARGS,
    PARAMS,
    assert_same_runs,
    disagg_config,
    prompts,
    run,
    run_pair,
)

SECRET = "kimi-s3cret"
PUBLISHED = Path(__file__).parent / "fixtures/published_configs/kimi_linear_48b_a3b_instruct"


def per_head_kv_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """What the MLA layers would keep a token as per-head K and V (transformers' expanded
    cache): heads x (qk_nope + qk_rope + v_head_dim) values a layer."""
    kimi = config.family
    mla = kimi.mla
    per_layer = mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    return len(kimi.uses("full_attention")) * per_layer * dtype.itemsize


def test_published_mla_keeps_one_latent_row_a_token_far_below_per_head_kv():
    config = ModelConfig.from_dict(json.loads((PUBLISHED / "config.json").read_text()))
    spec = model_state_spec(config, torch.bfloat16)
    assert spec.names("paged") == ("mla.latent",)
    # 7 MLA layers x (512 + 64) bf16 values = 8,064 bytes a token; per-head K/V would be
    # 7 x 32 x (192 + 128) x 2 = 143,360 (17.8x)
    assert spec.bytes_per_token() == 7 * (512 + 64) * 2 == 8064
    assert per_head_kv_bytes(config, torch.bfloat16) == 143_360
    assert spec.bytes_per_token(size=2, rank=1) == 8064  # replicated under TP, not split


def test_pools_hold_latent_pages_and_kda_slots_only(kimi_models):
    model_dir, hf = kimi_models("kimi_moe")
    engine = Engine(model_dir, **ARGS, max_total_tokens=256)
    pools = engine.cache.pools
    assert set(pools) == {"mla.latent", "kda.conv", "kda.recurrent"}
    latent = pools["mla.latent"]  # (MLA layers, token slots, kv_lora_rank + qk_rope_head_dim)
    assert latent.shape[0] == 1 and latent.shape[2] == 16 + 4
    tokens = latent.shape[1]
    assert latent.numel() * latent.element_size() == tokens * engine.cache.spec.bytes_per_token()
    config = ModelConfig.from_hf(model_dir)
    assert per_head_kv_bytes(config, torch.float32) == 4 * (12 + 8) * 4 == 4 * latent.shape[2] * 4
    out = run(engine, prompts(hf.config.vocab_size, 5, (9,)))
    assert len(out["r0"][0]) == PARAMS.max_tokens
    assert engine.stats().kv_pages_used == 0 and engine.stats().mamba_slots_used == 0


LINEAR_HYBRIDS = ["kimi_moe", "minimax_one_in_four"]


@pytest.mark.parametrize("name", LINEAR_HYBRIDS)
def test_prefix_cache_on_matches_off_with_hits(kimi_models, name):
    model_dir, hf = kimi_models(name)
    vocab = hf.config.vocab_size
    shared = prompts(vocab, 1, (70,))[0]
    items = [shared + p for p in prompts(vocab, 2, (5, 9, 13, 71))]
    off = LLM(model_dir, **ARGS, enable_prefix_caching=False).generate(items, PARAMS)
    on = LLM(model_dir, **ARGS, cpu_padded_decode=True)
    padded = []
    runner = on.engine.graph_runner
    original = runner.forward
    runner.forward = lambda sched: (padded.append(sched.num_decode_seqs), original(sched))[1]
    outs = on.generate(items[:1], PARAMS) + on.generate(items[1:], PARAMS)
    assert 3 in padded  # a batch of 3 decodes padded to the captured size 4
    assert_same_outputs(outs, off)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    again = on.generate(items[3:], PARAMS)  # its own prompt now cached up to 128 tokens
    assert again[0].num_cached_tokens == 128
    assert_same_outputs(again, off[3:])
    stats = on.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.fixture(scope="module")
def workers(kimi_models):
    """(model, role, tp size) -> its worker, built on first use, closed at the end."""
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_ENV, SECRET)
    context = zmq.Context()
    built: dict[tuple[str, str, int], PrefillWorker | DecodeWorker] = {}

    def get(name: str, role: str, size: int):
        if (name, role, size) not in built:
            model_dir, _ = kimi_models(name)
            engine = Engine(
                model_dir,
                tensor_parallel_size=size,
                handover_connector=connector_spec(role, "127.0.0.1"),
                **ARGS,
            )
            cls = PrefillWorker if role == "prefill" else DecodeWorker
            built[name, role, size] = cls(engine, disagg_config(role), context)
        return built[name, role, size]

    yield get
    for worker in built.values():
        worker.close()
        worker.engine.close()
    patch.undo()


@pytest.fixture(scope="module")
def colocated(kimi_models):
    """model -> (first round's prompts, second round's, what a colocated TP=1 engine answers to
    each), computed on first use."""
    done = {}

    def get(name: str):
        if name not in done:
            model_dir, hf = kimi_models(name)
            items = prompts(hf.config.vocab_size, 3, (9, 70, 131))
            again = [p + [7, 8, 9] for p in items]
            engine = Engine(model_dir, **ARGS, enable_prefix_caching=False)
            done[name] = items, again, run(engine, items), run(engine, again)
        return done[name]

    return get


@pytest.mark.parametrize(
    "name,sizes",
    [
        # Kimi's 1 -> 1 pair runs over HTTP in test_new_mixers_serve.py (~5 s saved here)
        ("kimi_moe", (2, 1)),
        ("minimax_one_in_four", (1, 1)),
        ("minimax_one_in_four", (2, 1)),
    ],
)
def test_pd_pair_matches_colocated(workers, colocated, sizes, name):
    items, again, expected, expected_again = colocated(name)
    prefill, decoder = workers(name, "prefill", sizes[0]), workers(name, "decode", sizes[1])
    hits = [w.stats().prefix_cache_hit_tokens for w in (prefill, decoder)]
    assert_same_runs(run_pair(prefill, decoder, items, f"a{sizes}"), expected)
    assert_same_runs(run_pair(prefill, decoder, again, f"b{sizes}"), expected_again)
    # the second round resumed from KDA checkpoints and latent pages on both workers
    assert all(w.stats().prefix_cache_hit_tokens > h for w, h in zip((prefill, decoder), hits))


@pytest.mark.parametrize(
    "name",
    [
        "kimi_dense_first",  # 4 KDA heads, MLA with q_lora and bias
        "minimax_one_in_four",  # 4 lightning heads, softmax attention 4/2, 4 experts
    ],
)
def test_tensor_parallel_matches_one_rank(kimi_models, name):
    model_dir, hf = kimi_models(name)
    items = prompts(hf.config.vocab_size, 4, (11, 80))
    expected = run(Engine(model_dir, **ARGS), items)
    engine = Engine(model_dir, tensor_parallel_size=2, **ARGS)
    try:
        assert_same_runs(run(engine, items), expected)
    finally:
        engine.close()


@pytest.mark.parametrize("name", LINEAR_HYBRIDS)
def test_speculative_verify_keeps_plain_outputs_at_every_acceptance_count(kimi_models, name):
    """A scripted drafter (tests/spec_helpers.py) makes every acceptance count from 0 to k happen:
    KDA keeps its conv window and state after each drafted position in that position's slot, MLA
    attends the verify rows over the latent pages, rejected pages are freed; greedy output and
    its logprobs are plain decoding's (MiniMax: lightning attention's state likewise)."""
    model_dir, hf = kimi_models(name)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    items = prompts(hf.config.vocab_size, 6, (9, 50, 61))
    want = LLM(model_dir, **ARGS).generate(items, greedy)
    reference = {tuple(p): o.token_ids for p, o in zip(items, want)}
    spec = scripted_llm(model_dir, reference, 2, **ARGS)
    assert_same_outputs(spec.generate(items, greedy), want)
    stats = spec.stats()
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
