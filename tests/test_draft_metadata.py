"""The MTP head's draft passes take their metadata from the step they follow
(engine/executor/draft_metadata.py): what they read equals a fresh build, whatever other builds
wrote into the shared fixed buffers meanwhile, and a replay that read stale metadata would change
the drafts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.executor import draft_plans
from baton.engine.executor.cpu_plan import plans_available
from baton.engine.executor.draft_metadata import advance, retoken, with_tokens
from baton.engine.executor.forward_metadata import ScheduledBatch
from baton.engine.executor.static_copy import _walk
from tests.test_metadata import graph_runner, only_verify_rows, scheduled

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def leaves(value, path="md"):
    """(path, value) of every tensor and host value in a metadata object, as copy_from walks."""
    walk = _walk(type(value))
    if walk is None or walk == "tensor":
        yield path, value
        return
    for name in walk:
        yield from leaves(getattr(value, name), f"{path}.{name}")


def assert_reads_the_same(got, want, kv_lens: list[int]) -> None:
    """Every tensor and host value equal; token tables and masks only in the key columns each
    row reads (past kv_len they are stale in any build: no kernel reads them)."""
    for (path, a), (_, b) in zip(leaves(got), leaves(want), strict=True):
        if not isinstance(a, torch.Tensor):
            assert a == b, path
        elif path.endswith(("decode_attention.kv_indices", "decode_attention.mask")):
            for row, n in enumerate(kv_lens):
                assert torch.equal(a[row, ..., :n], b[row, ..., :n]), (path, row)
        else:
            assert a.shape == b.shape and torch.equal(a, b), path


def verify_step() -> ScheduledBatch:
    """Two verify rows of 3 tokens whose pages reach past their drafted positions (the
    scheduler reserves the chain's lookahead with the step)."""
    sched = only_verify_rows(scheduled("verify", track=False))
    return dataclasses.replace(sched, kv_pages=((26, 27, 28, 25), tuple(range(29, 38))))


def chain_rows(verify: ScheduledBatch, accepted: tuple[int, ...], t: int) -> ScheduledBatch:
    """The chained pass t of the rows of `verify` after `accepted` drafts each."""
    n = verify.num_seqs
    return ScheduledBatch(
        mode="decode",
        request_ids=verify.request_ids,
        num_decode_seqs=n,
        num_verify_seqs=0,
        input_ids=tuple(100 + 7 * j + t for j in accepted),
        seq_lens=(1,) * n,
        start_positions=tuple(s + j + t for s, j in zip(verify.start_positions, accepted)),
        kv_pages=verify.kv_pages,
        mamba_slots=verify.mamba_slots,
        verify_slots=(),
        logits_seqs=tuple(range(n)),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=False,
        track_points=(),
        lora_slots=(-1,) * n,
    )


@pytest.mark.parametrize("mask", [True, False])
def test_an_advanced_chain_pass_reads_what_a_fresh_build_gives(mask):
    """The chained pass's recorded metadata, refilled in place after each verify step (whose
    build staged its own parts over the same fixed buffers), equals a fresh build of the pass's
    rows in every tensor, for every acceptance and the padding rows."""
    runner, fresh = graph_runner(verify_width=3), graph_runner(verify_width=3)
    for r in (runner, fresh):
        r.buffers = r.static_buffers()
        r.runner.decode_reads_mask = lambda: mask
    verify = verify_step()
    recorded = runner.build(runner.pad(chain_rows(verify, (0, 0), 1), 4))
    for accepted in [(0, 2), (2, 1), (1, 0), (2, 2)]:
        step = runner.build(runner.pad(verify, 4))  # the next verify step's build
        for t in (1, 2):
            chain = chain_rows(verify, accepted, t)
            advance(recorded, chain, step.forward.verify_attention.kv_indices)
            kv_lens = [p + 1 for p in chain.start_positions] + [1, 1]
            want = fresh.build(fresh.pad(chain, 4))
            assert_reads_the_same(recorded, want, kv_lens)
            assert recorded.forward.slot_mapping[2:].tolist() == [0, 0]  # dummy page 0


def test_a_chain_pass_that_is_not_refilled_reads_stale_metadata():
    """The check above has teeth: left as recorded, the pass's metadata is not the build's."""
    runner, fresh = graph_runner(verify_width=3), graph_runner(verify_width=3)
    for r in (runner, fresh):
        r.buffers = r.static_buffers()
    verify = verify_step()
    recorded = runner.build(runner.pad(chain_rows(verify, (0, 0), 1), 4))
    runner.build(runner.pad(verify, 4))
    chain = chain_rows(verify, (2, 1), 1)
    with pytest.raises(AssertionError):
        kv_lens = [p + 1 for p in chain.start_positions] + [1, 1]
        assert_reads_the_same(recorded, fresh.build(fresh.pad(chain, 4)), kv_lens)


def test_retoken_writes_what_with_tokens_derives():
    runner = graph_runner(verify_width=3)
    runner.buffers = runner.static_buffers()
    verify = verify_step()
    step = runner.build(runner.pad(verify, 4))
    first = dataclasses.replace(verify, input_ids=tuple(range(50, 56)), logits_seqs=(0, 1))
    static = with_tokens(step, first)
    later = dataclasses.replace(first, input_ids=tuple(range(60, 66)))
    retoken(static, later)
    want = with_tokens(step, later).forward.batch
    assert torch.equal(static.forward.batch.input_ids, want.input_ids)
    assert torch.equal(static.forward.batch.logits_indices, want.logits_indices)
    one_row = dataclasses.replace(
        later,
        request_ids=later.request_ids[:1],
        num_verify_seqs=1,
        input_ids=later.input_ids[:3],
        seq_lens=later.seq_lens[:1],
        start_positions=later.start_positions[:1],
        kv_pages=later.kv_pages[:1],
        mamba_slots=later.mamba_slots[:1],
        verify_slots=later.verify_slots[:1],
        logits_seqs=(0,),
        lora_slots=later.lora_slots[:1],
    )
    with pytest.raises(ValueError, match="logits rows"):  # plans are keyed by them
        retoken(static, one_row)


# --- the engine: captured drafts are the eager drafts -----------------------------------------


def drafts_of(llm, prompts) -> list[dict]:
    """Every step's drafts (seq -> tokens) while generating."""
    engine, seen = llm.engine, []
    propose = engine.drafter.propose

    def logged(*args):
        drafts = propose(*args)
        seen.append(dict(drafts))
        return drafts

    engine.drafter.propose = logged
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return seen


def mtp_llm(**args):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    return LLM(str(ASSETS), dtype="float32", page_size=4, speculative_config=spec, **args)


needs_plans = pytest.mark.skipif(not plans_available(), reason="no C++ extension: no plans")


@needs_plans
def test_captured_draft_passes_draft_what_eager_ones_do_with_one_build_a_step():
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 9, 27, 81, 11]]
    eager = drafts_of(mtp_llm(cpu_step_capture=False), prompts)
    llm = mtp_llm()
    drafts_of(llm, prompts)  # records the plans
    graphs = llm.engine.graph_runner
    builds, steps = [], graphs.num_padded_steps
    build = graphs.build
    graphs.build = lambda padded: builds.append(padded.mode) or build(padded)
    assert drafts_of(llm, prompts) == eager
    assert {key[0] for key, plan in graphs.draft_plans.items() if plan} == {"target", "chain"}
    assert "verify" in builds
    # one build per step the graph runner ran (the target's): the draft passes build nothing
    assert len(builds) == graphs.num_padded_steps - steps


@needs_plans
def test_a_chain_pass_replayed_over_stale_metadata_drafts_otherwise(monkeypatch):
    """The engine-level check has teeth: a chained pass whose positions lag one step behind
    (its tokens refilled, its positions, key lengths and KV slots those of the step before)
    drafts other tokens."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]]
    eager = drafts_of(mtp_llm(cpu_step_capture=False), prompts)
    llm = mtp_llm()
    drafts_of(llm, prompts)

    def one_behind(static, sched, token_slots):
        positions = tuple(p - 1 for p in sched.start_positions)
        advance(static, dataclasses.replace(sched, start_positions=positions), token_slots)

    monkeypatch.setattr(draft_plans, "advance", one_behind)
    assert drafts_of(llm, prompts) != eager
