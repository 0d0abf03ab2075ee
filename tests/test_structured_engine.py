"""Structured outputs in the engine, on the shipped model (engine/structured_output/grammars.py):
outputs follow their grammar, logprobs stay the model's, and grammars compile off the step
loop, colocated and across a disaggregated handover."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import zmq

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.core.engine import Engine
from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from tests.test_disagg_unit import config, run_pair

ASSETS = Path(__file__).parents[1] / "assets"
PROMPT = "Question: Tom has 13 apples and buys 24 more. How many apples does he have?\nAnswer:"
# bounded fields only: the tiny model ends it well within max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["apples", "pens"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "unit", "sure"],
}


def grammar(kind: str, spec, after: tuple[int, ...] = ()) -> StructuredOutputs:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return StructuredOutputs(kind=kind, spec=text, after_token_ids=after)


def follows(instance, schema) -> bool:
    jsonschema.validate(instance, schema)  # raises, naming the broken rule
    return True


@pytest.fixture(scope="module")
def llm():
    with LLM(ASSETS, dtype="float32", device="cpu", page_size=4) as llm:
        yield llm


def test_outputs_that_stop_follow_their_grammar(llm):
    cases = [
        (grammar("json", SCHEMA), lambda text: follows(json.loads(text), SCHEMA)),
        (
            grammar("regex", r"[a-z]{1,4} \d\d?"),
            lambda text: re.fullmatch(r"[a-z]{1,4} \d\d?", text),
        ),
        (grammar("choice", ["pens", "apples"]), lambda text: text in ("pens", "apples")),
    ]
    for structured, valid in cases:
        greedy = SamplingParams(max_tokens=64, temperature=0, structured_outputs=structured)
        sampled = SamplingParams(
            max_tokens=64, temperature=1.0, seed=7, n=2, structured_outputs=structured
        )
        outputs = llm.generate([PROMPT, PROMPT], [greedy, sampled])
        for out in outputs:
            assert out.finish_reason == "stop", (structured.kind, out.text)
            assert valid(out.text), (structured.kind, out.text)
    assert llm.stats().kv_pages_used == 0 and llm.stats().mamba_slots_used == 0
    assert llm.engine.grammars.requests == {}  # every matcher let go with its request


def test_seeded_samples_repeat_and_differ_from_each_other(llm):
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, n=2, structured_outputs=grammar("regex", "[a-z ]+")
    )
    first = [out.token_ids for out in llm.generate([PROMPT], params)]
    again = [out.token_ids for out in llm.generate([PROMPT], params)]
    assert first == again and first[0] != first[1]


def test_logprobs_are_the_models_before_the_mask(llm):
    free = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    forced = llm.generate(
        [PROMPT],
        SamplingParams(
            max_tokens=1, temperature=0, logprobs=5, structured_outputs=grammar("regex", "Z")
        ),
    )[0]
    (token,) = forced.token_ids
    assert forced.text == "Z" and token not in free.logprobs[0]
    top = {t: lp for t, lp in forced.logprobs[0].items() if t != token}
    assert top == pytest.approx(free.logprobs[0], abs=1e-5)
    # the only token the grammar allows keeps its own, unlikely logprob (not 0 = renormalised)
    assert forced.logprobs[0][token] < min(top.values())


def test_a_length_cut_is_reported_as_length(llm):
    params = SamplingParams(
        max_tokens=3, temperature=0, structured_outputs=grammar("regex", r"\d+")
    )
    out = llm.generate([PROMPT], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert re.fullmatch(r"\d+", out.text)


def test_a_complete_grammar_stops_even_with_ignore_eos_and_min_tokens(llm):
    for extra in ({"ignore_eos": True}, {"min_tokens": 8}):
        params = SamplingParams(
            max_tokens=20, temperature=0, structured_outputs=grammar("choice", ["yes"]), **extra
        )
        out = llm.generate([PROMPT], params)[0]
        assert (out.text, out.finish_reason) == ("yes", "stop"), extra
        assert out.token_ids[-1] == 2  # its end is the model's EOS


def test_grammar_waits_for_its_after_token_ids(llm):
    free = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0]
    marker = tuple(free.token_ids[1:3])  # the grammar starts after the free text's 2nd, 3rd ids
    params = SamplingParams(
        max_tokens=12, temperature=0, structured_outputs=grammar("regex", r"\d\d!", marker)
    )
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids[:3] == free.token_ids[:3]
    tail = llm.tokenizer.decode(out.token_ids[3:], skip_special_tokens=True)
    assert re.fullmatch(r"\d\d!", tail) and out.finish_reason == "stop"


def test_a_dead_end_aborts_with_the_models_stop_token(llm):
    params = SamplingParams(
        max_tokens=6, temperature=0, structured_outputs=grammar("regex", r"a[^\s\S]")
    )
    out = llm.generate([PROMPT], params)[0]
    assert (out.text, out.token_ids[-1], out.finish_reason) == ("a", 2, "abort")


def test_a_grammar_that_admits_nothing_is_refused_and_frees_all(llm):
    params = [
        SamplingParams(max_tokens=4, temperature=0),
        SamplingParams(max_tokens=4, structured_outputs=grammar("grammar", "root ::= root")),
    ]
    with pytest.raises(ValueError, match="admits no output"):
        llm.generate([PROMPT, PROMPT], params)
    assert not llm.engine.has_unfinished_requests() and llm.engine.grammars.requests == {}
    assert llm.stats().kv_pages_used == 0 and llm.stats().mamba_slots_used == 0
    with pytest.raises(ValueError, match="invalid regex"):  # checked before anything runs
        llm.generate([PROMPT], SamplingParams(structured_outputs=grammar("regex", "(")))


def test_prefix_caching_and_preemption_keep_the_outputs():
    shared = "Question: Ann has 5 pens and buys 3 more. How many pens?\nAnswer: 8\n\n" * 3
    prompts = [shared + PROMPT + " " * i for i in range(6)]  # 64 tokens in common
    params = SamplingParams(
        max_tokens=64, temperature=0, structured_outputs=grammar("json", SCHEMA)
    )
    with LLM(ASSETS, page_size=4, enable_prefix_caching=False) as plain:
        expected = [out.token_ids for out in plain.generate(prompts, params)]
    # a pool too small for six requests at once: some are preempted and recomputed
    with LLM(ASSETS, page_size=4, max_total_tokens=480, mamba_track_interval=64) as cramped:
        got = [out.token_ids for out in cramped.generate(prompts, params)]
        again = [out.token_ids for out in cramped.generate(prompts, params)]  # cache hits
        assert cramped.stats().num_preemptions > 0
        assert cramped.stats().prefix_cache_hit_tokens > 0
    assert got == expected and again == expected


def hold_compiles(engine: Engine, monkeypatch, until) -> None:
    """Make this engine's grammar compiles wait until `until()` is true (polled)."""
    compile_now = engine.grammars._compile

    def late_compile(structured):
        deadline = time.monotonic() + 60
        while not until():  # (a compile that raises refuses its request: the test fails)
            if time.monotonic() > deadline:
                raise RuntimeError("the awaited condition never came")
            time.sleep(0.01)
        return compile_now(structured)

    monkeypatch.setattr(engine.grammars, "_compile", late_compile)


def test_other_requests_step_while_a_grammar_compiles(llm, monkeypatch):
    engine = llm.engine
    release = threading.Event()
    hold_compiles(engine, monkeypatch, release.is_set)
    prompt = llm.tokenizer.encode(PROMPT)
    structured = grammar("choice", ["pens", "apples"])
    engine.add_request("plain", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("json", prompt, SamplingParams(max_tokens=8, structured_outputs=structured))
    tokens: dict[str, list[int]] = {"plain": [], "json": []}
    while len(tokens["plain"]) < 8:  # the plain request runs to its end meanwhile
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    assert tokens["json"] == [] and engine.grammars.num_held == 1
    release.set()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    assert llm.tokenizer.decode(tokens["json"], skip_special_tokens=True) in ("pens", "apples")


def test_disaggregated_output_is_the_colocated_one_with_a_late_decode_compile(monkeypatch):
    """The decode side replays the prefill's first token into its own matcher (the state is
    not carried): here its compile ends only after the state was installed."""
    params = SamplingParams(
        max_tokens=64, temperature=1.0, seed=11, structured_outputs=grammar("json", SCHEMA)
    )
    prompts = [list(range(3, 40)), list(range(5, 70))]
    colocated = Engine(ASSETS, page_size=4)
    expect = {}
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"r{i}", prompt, params)
    while colocated.has_unfinished_requests():
        for delta in colocated.step():
            expect.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    ctx = zmq.Context()
    prefill = PrefillWorker(Engine(ASSETS, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(ASSETS, page_size=4), config("decode"), ctx)
    # the decode side compiles only once a transferred request waits installed for it
    hold_compiles(decoder.engine, monkeypatch, lambda: decoder.engine.grammars.num_held > 0)
    try:
        got = run_pair(prefill, decoder, prompts, params, timeout=60)
        assert got == expect
        assert all(t[-1] == 2 for t in got.values())  # each ended by its grammar
    finally:
        prefill.close()
        decoder.close()


def test_a_grammar_over_its_matcher_time_budget_ends_and_the_others_go_on(llm, monkeypatch):
    from baton.engine.structured_output import grammars

    monkeypatch.setattr(grammars, "MATCHER_BUDGET_S", 0.0)
    monkeypatch.setattr(grammars, "MATCHER_BUDGET_PER_TOKEN_S", 0.0)
    plain = SamplingParams(max_tokens=5, ignore_eos=True)
    costly = SamplingParams(max_tokens=5, structured_outputs=grammar("regex", "[a-z ]+"))
    free, cut = llm.generate([PROMPT, PROMPT], [plain, costly])
    assert (len(free.token_ids), free.finish_reason) == (5, "length")
    assert (len(cut.token_ids), cut.finish_reason) == (1, "abort")


def test_a_stop_string_still_cuts_a_constrained_answer(llm):
    params = SamplingParams(
        max_tokens=20,
        temperature=0,
        stop=["."],
        structured_outputs=grammar("choice", ["yes. and more", "no. and less"]),
    )
    out = llm.generate([PROMPT], params)[0]
    assert out.text in ("yes", "no") and (out.finish_reason, out.stop_reason) == ("stop", ".")
    assert not llm.engine.has_unfinished_requests() and llm.stats().kv_pages_used == 0


def test_a_schema_that_lowers_past_64_kib_runs_and_its_output_follows_it(llm):
    """The check accepts up to 256 KiB of lowered constraints (JSONSchemaBench's largest are
    ~240 KB); the engine compiles what the check accepts."""
    first = {f"field_{i}": {"type": "integer", "minimum": i, "maximum": i + 9} for i in range(1500)}
    schema = {"type": "object", "properties": {"answer": SCHEMA, **first}, "required": ["answer"]}
    structured = grammar("json", schema)
    assert len(check_structured_outputs(structured).spec) > 64 * 1024
    (output,) = llm.generate(
        [PROMPT], SamplingParams(max_tokens=200, temperature=0, structured_outputs=structured)
    )
    if output.finish_reason == "stop":
        assert follows(json.loads(output.text), schema)
    else:
        assert output.finish_reason == "length" and output.text.startswith('{"answer": {')
