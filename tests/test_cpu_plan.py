"""The captured CPU step (engine/executor/cpu_plan.py): the recorder's rules on small functions,
then every family's decode (and speculative verify) step replayed from a plan against the
eager step, token for token with logprobs within 1e-5 in fp32, and the two ways a capture goes
wrong made to happen: a replay reading a stale metadata buffer, and a checkpointing step
replayed from the plan recorded without its track mask. Both must change the outputs, so the
equality tests above would catch them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.executor import graph_runner as graph_runner_module
from baton.engine.executor.cpu_plan import Recorder, new_plan, plans_available
from baton.engine.executor.metadata_buffers import MetadataBuffers
from tests.same_outputs import chosen
from tests.spec_helpers import ScriptedDrafter, ngram_config

pytestmark = pytest.mark.skipif(not plans_available(), reason="the C++ extension is not built")

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOLERANCE = 1e-5
LENGTHS = (3, 11, 26, 7, 1)
NEW_TOKENS = (12, 9, 14, 6, 11)


def record(fn, *args):
    plan = new_plan()
    with torch.inference_mode(), Recorder(plan) as recorder:
        out = fn(*args)
    return plan, recorder, out


def test_replay_refills_views_in_place_writes_and_functional_results():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)
    x = torch.randn(4, 8, generator=gen)
    acc = torch.zeros(4, 16)

    def step(x):
        y = torch.nn.functional.linear(x, weight, bias)  # addmm: replayed through addmm.out
        y = torch.nn.functional.silu(y) * 2  # a Python number where aten takes a Tensor
        acc.add_(y)  # in place
        halves = y.view(2, 32).unbind(0)  # views: nothing to replay
        return torch.cat(halves).sum(-1), torch.topk(y, 3).values  # several results

    plan, recorder, (total, top) = record(step, x)
    assert recorder.error is None and 0 < len(plan) < recorder.calls
    for _ in range(2):
        x.copy_(torch.randn(4, 8, generator=gen))
        before = acc.clone()
        with torch.inference_mode():
            acc_eager = acc.clone()
            acc.copy_(before)
            want_total, want_top = step(x)
            acc_eager, acc_want = acc.clone(), acc_eager
            acc.copy_(acc_want)
            plan.replay()
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
        torch.testing.assert_close(top, want_top, rtol=0, atol=0)
        torch.testing.assert_close(acc, acc_eager, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_a_2d_linear_replays_as_one_matmul_call(bias):
    """A 2-D linear is recorded as the call aten's linear makes for it (mm, or addmm with a
    bias, on the weight's transpose): one dispatcher call a replay, the same result bit for
    bit; a 3-D one stays a linear."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 8, generator=gen)
    b = torch.randn(16, generator=gen) if bias else None
    x, x3 = torch.randn(4, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    names = []

    class Names(Recorder):
        def _append(self, name, overload, args, copy_into, check_zero):
            names.append(name)
            super()._append(name, overload, args, copy_into, check_zero)

    plan = new_plan()
    with torch.inference_mode(), Names(plan) as recorder:
        y = torch.ops.aten.linear(x, weight, b)
        y3 = torch.ops.aten.linear(x3, weight, b)
    assert recorder.error is None
    assert names == ["aten::addmm" if bias else "aten::mm", "aten::linear"]
    for _ in range(2):
        x.copy_(torch.randn(4, 8, generator=gen))
        x3.copy_(torch.randn(2, 3, 8, generator=gen))
        plan.replay()
        with torch.inference_mode():
            torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, b), rtol=0, atol=0)
            torch.testing.assert_close(
                y3, torch.nn.functional.linear(x3, weight, b), rtol=0, atol=0
            )


@pytest.mark.parametrize(
    ("what", "fn"),
    [
        ("host value", lambda x: x * float(x.sum())),  # .item(): Python branches on it
        ("data-shaped", lambda x: x[x > 0].sum()),  # boolean indexing: nonzero
    ],
)
def test_what_a_replay_cannot_reproduce_stops_the_capture(what, fn):
    x = torch.randn(5)
    plan, recorder, out = record(fn, x)
    assert recorder.error is not None, what
    torch.testing.assert_close(out, fn(x))  # the recorded step itself ran to its end


def test_a_kernel_error_in_a_replay_raises_naming_it():
    """A C kernel's result is its error code (here: a slot outside the pool); recorded as 0, it
    is checked again on every replay."""
    from baton.kernels.cpu.ops import library

    lib = library()
    H, P, N, G = 2, 4, 8, 1
    pool = torch.zeros(3, H, P, N)
    slots = torch.tensor([1, 2])
    x, dt = torch.randn(2, H, P), torch.rand(2, H)
    A, D = -torch.rand(H), torch.ones(H)
    B, C = torch.randn(2, G, N), torch.randn(2, G, N)
    y = torch.empty(2, H, P)

    def step():
        return lib.baton_ssu_f32(pool, 3, slots, 2, x, dt, A, B, C, D, y, H, P, N, G, 1)

    plan, recorder, result = record(step)
    assert result == 0 and recorder.error is None and len(plan) == 1
    plan.replay()
    slots[1] = 7  # outside the pool of 3
    with pytest.raises(RuntimeError, match="ssu_f32.*failed with code 2"):
        plan.replay()


# --- every family: captured == eager -----------------------------------------------------

FAMILIES = [
    ("tiny_models", "base"),  # NemotronH
    ("family_models", "bamba_a"),
    ("family_models", "granite_moe"),
    ("family_models", "falcon_mup"),
    ("family_models", "zamba2_shared"),
    ("gdn_models", "qwen3_next_moe"),
    ("gdn_models", "qwen3_5_dense"),
    ("gdn_models", "olmo_hybrid_rope"),
    ("ssm_models", "jamba_moe"),
    ("ssm_models", "lfm2_moe_a"),
    ("ssm_models", "mamba_a"),
    ("ssm_models", "mamba2_a"),
    ("kimi_models", "minimax_one_in_four"),  # lightning attention + softmax attention + MoE
    ("kimi_models", "kimi_moe"),  # KDA + MLA latent pages + grouped MoE
    ("kimi_models", "bailing_safe_gate"),  # KDA's bounded gate + MLA with interleaved rotary
    ("window_models", "rgemma_hawk"),  # RecurrentGemma's RG-LRU only
    ("window_models", "rgemma_local"),  # RG-LRU + local attention, a window shorter than prompts
    ("window_models", "lfm3_sliding"),  # LFM3 with sliding layers only: pages released
    ("window_models", "lfm3_mixed"),  # sliding + full attention: two page tables
]


def prompts_for(vocab: int, seed: int = 21) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def params():
    return [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2) for m in NEW_TOKENS
    ]


def assert_outputs_match(got, expected, tolerance=TOLERANCE):
    for i, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine.token_ids == theirs.token_ids, f"request {i}: tokens differ"
        worst = max(
            abs(a - b)
            for a, b in zip(
                chosen(mine.token_ids, mine.logprobs), chosen(theirs.token_ids, theirs.logprobs)
            )
        )
        assert worst <= tolerance, f"request {i}: logprobs differ by {worst:.3g}"


def assert_replayed(llm) -> None:
    runner = llm.engine.graph_runner
    assert runner is not None and runner.capture == "cpu"
    assert runner.num_replays > 0
    failed = [key for key, plan in runner.plans.items() if plan is None]
    assert not failed, f"steps that could not be captured: {failed}"


@pytest.mark.parametrize(("fixture", "name"), FAMILIES, ids=[n for _, n in FAMILIES])
def test_captured_step_equals_eager(request, fixture, name):
    model_dir, hf = request.getfixturevalue(fixture)(name)
    prompts = prompts_for(hf.config.vocab_size)
    args = dict(page_size=4, max_num_batched_tokens=32, chunked_prefill_size=16)
    eager = LLM(model_dir, **args, cpu_step_capture=False).generate(prompts, params())
    captured = LLM(model_dir, **args)
    assert_outputs_match(captured.generate(prompts, params()), eager)
    assert_replayed(captured)


@pytest.mark.parametrize("method", ["mtp", "scripted"])
def test_captured_verify_step_equals_eager(request, method):
    """Speculative verify rows (k + 1 tokens each, every acceptance count from 0 to k with the
    scripted drafter) replayed from their own plans; the MTP head drafts from the replayed
    step's hidden states."""
    if method == "mtp":  # the shipped model carries an MTP layer
        model_dir = ASSETS
        vocab = json.loads((ASSETS / "config.json").read_text())["vocab_size"]
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        model_dir, hf = request.getfixturevalue("tiny_models")("base")
        vocab = hf.config.vocab_size
        spec = ngram_config(3)
    prompts = prompts_for(vocab, seed=5)

    def run(**args):
        llm = LLM(model_dir, page_size=4, speculative_config=spec, **args)
        if method == "scripted":
            plain = LLM(model_dir, page_size=4, cpu_step_capture=False).generate(prompts, params())
            reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
            llm.engine.drafter = ScriptedDrafter(reference, 3, vocab)
        return llm, llm.generate(prompts, params())

    _, eager = run(cpu_step_capture=False)
    captured, outputs = run()
    assert_outputs_match(outputs, eager)
    assert_replayed(captured)
    runner = captured.engine.graph_runner
    assert any(key[0] == "verify" for key in runner.plans)
    assert captured.stats().spec_decode_num_drafts > 0
    if method == "mtp":  # the head's first and chained passes replayed from their own plans
        assert {key[0] for key, plan in runner.draft_plans.items() if plan} == {"target", "chain"}


# --- the failures the equality tests must catch -------------------------------------------


def test_a_replay_reading_a_stale_metadata_buffer_changes_the_outputs(base_model, monkeypatch):
    """After the first (recorded) step of each shape, the builder writes into buffers of its own
    and `copy_from` moves nothing: the plan reads the recorded step's metadata again."""
    model_dir, hf = base_model
    prompts = prompts_for(hf.config.vocab_size)
    eager = LLM(model_dir, page_size=4, cpu_step_capture=False).generate(prompts, params())
    llm = LLM(model_dir, page_size=4)
    runner = llm.engine.graph_runner
    original_build = runner.build

    def stale_build(padded):
        md = original_build(padded)
        runner.buffers = MetadataBuffers("cpu", ints=1 << 16, kv_rows=16, kv_width=4096, fixed=True)
        return md

    monkeypatch.setattr(runner, "build", stale_build)
    monkeypatch.setattr(graph_runner_module, "copy_from", lambda static, new: None)
    with pytest.raises(AssertionError, match="differ"):
        assert_outputs_match(llm.generate(prompts, params()), eager)
    assert runner.num_replays > 0


def test_a_capture_that_drops_the_track_mask_changes_the_outputs(base_model, monkeypatch):
    """Decode steps that checkpoint the Mamba state (the track mask) recorded and replayed with
    the flag dropped (the seed bug, in the capture's metadata): the checkpoints are never
    written and the second turns, resumed from them, go wrong. With the flag the same turns
    match the eager engine. (A replay whose flag differs from its recording is refused by
    copy_from: host values are fixed per plan.)"""
    model_dir, hf = base_model
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 33)
    ]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)

    def second_turn(llm):
        first = llm.generate(prompts, greedy)
        turns = [p + o.token_ids[:30] + [9] for p, o in zip(prompts, first)]
        return llm.generate(turns, greedy)

    args = dict(page_size=4, mamba_track_interval=32, max_mamba_slots=16)
    reference = second_turn(LLM(model_dir, **args, cpu_step_capture=False))
    kept = LLM(model_dir, **args)
    assert_outputs_match(second_turn(kept), reference)
    assert any(key[2] for key in kept.engine.graph_runner.plans)  # checkpointing steps replayed

    llm = LLM(model_dir, **args)
    runner = llm.engine.graph_runner
    build = runner.build
    monkeypatch.setattr(
        runner,
        "build",
        lambda padded: dataclasses.replace(build(padded), has_mamba_track_mask=False),
    )
    with pytest.raises(AssertionError, match="differ"):
        assert_outputs_match(second_turn(llm), reference)
