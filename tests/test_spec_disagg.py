"""Speculation across processes: a PD pair with MTP drafting equals colocated MTP speculation
(the prefill worker builds the MTP head's K/V over the prompt and hands it over with the last
hidden state; the decode worker drafts before its first step: the same drafts, the same verify
steps), and at tensor-parallel size 2 the MTP head, the verify steps and the checkpoint copies
of accepted positions run on every rank with the outputs of size 1."""

from __future__ import annotations

import pytest
import zmq

from baton import LLM, SamplingParams
from baton.engine.core.engine import Engine
from tests.mtp_models import add_mtp_layer
from tests.spec_helpers import ScriptedDrafter
from tests.test_disagg_families import assert_as_colocated, close, pair
from tests.test_disagg_unit import assert_pools_empty

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
PROMPTS = [
    ("long", [(7 * i) % 300 + 3 for i in range(41)]),
    ("short", [5, 9, 14]),
    ("block", [(11 * i) % 290 + 4 for i in range(16)]),
]


@pytest.fixture(scope="module")
def mtp_model(tiny_models, tmp_path_factory):
    source, _ = tiny_models("moe_nano")
    dest = tmp_path_factory.mktemp("spec-disagg") / "model"
    add_mtp_layer(source, dest, ["full_attention", "moe"])
    return dest


def first_drafts_colocated(engine: Engine) -> dict[str, list[int]]:
    """Each request's drafts right after its prefill, on one engine."""
    drafts: dict[str, list[int]] = {}
    for rid, prompt in PROMPTS:
        engine.add_request(rid, prompt, PARAMS)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            req = engine.scheduler.requests.get(delta.request_id)
            if req is not None and len(req.output_ids) == 1:
                drafts[delta.request_id] = list(req.drafts)
    return drafts


def test_pd_pair_drafts_at_once_and_matches_colocated_speculation(mtp_model, monkeypatch):
    args = dict(page_size=4, mamba_track_interval=16, speculative_config=SPEC)
    run = pair(mtp_model, zmq.Context(), args | dict(chunked_prefill_size=11), args)
    decode_engine = run.decoder.engine
    handed_over: dict[str, list[int]] = {}
    set_drafts = decode_engine.scheduler.set_drafts

    def record(req, drafts):
        handed_over[req.request_id] = list(drafts)
        set_drafts(req, drafts)

    monkeypatch.setattr(decode_engine.scheduler, "set_drafts", record)
    try:
        run(PROMPTS, PARAMS)
        reference = Engine(mtp_model, **args)
        assert handed_over == first_drafts_colocated(reference)
        assert_as_colocated(run, Engine(mtp_model, enable_prefix_caching=False), PROMPTS, PARAMS)
        # the same verify rows as colocated: none was lost to a first step without drafts
        pd, colocated = decode_engine.stats(), reference.stats()
        assert pd.spec_decode_num_drafts == colocated.spec_decode_num_drafts > 0
        assert pd.spec_decode_num_accepted_tokens == colocated.spec_decode_num_accepted_tokens
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)


def test_tp2_speculation_matches_tp1(mtp_model):
    """MTP drafting on both ranks, then a scripted drafter's verify steps with every acceptance
    count (rollback and the checkpoint copies of accepted positions on every rank)."""
    prompts = [prompt for _, prompt in PROMPTS]
    args = dict(page_size=4, mamba_track_interval=16)
    want = LLM(mtp_model, **args).generate(prompts, PARAMS)
    tp1 = LLM(mtp_model, speculative_config=SPEC, **args)
    tp1_out = tp1.generate(prompts, PARAMS)
    with LLM(mtp_model, tensor_parallel_size=2, speculative_config=SPEC, **args) as tp2:
        assert [o.token_ids for o in tp2.generate(prompts, PARAMS)] == [
            o.token_ids for o in tp1_out
        ]
        assert tp2.stats().spec_decode_num_drafts == tp1.stats().spec_decode_num_drafts
        # every rank replayed captured verify steps and draft passes (their collectives too)
        graphs = tp2.engine.graph_runner
        assert graphs.num_replays > 0 and any(p is not None for p in graphs.plans.values())
        assert any(p is not None for p in graphs.draft_plans.values())
        reference = {tuple(p): o.token_ids for p, o in zip(prompts, want)}
        tp2.engine.drafter = ScriptedDrafter(reference, 2, tp2.engine.model_config.vocab_size)
        tp2.engine.reset_prefix_cache()
        got = tp2.generate(prompts, PARAMS)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert tp2.stats().spec_decode_num_accepted_tokens > 0
        assert tp2.engine.ranks.pool_digests(tp2.engine.cache)  # every rank still answers
