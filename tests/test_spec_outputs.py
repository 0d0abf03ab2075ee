"""What ends or shapes an output holds under speculation as without it: stop strings, stop
tokens, max_tokens and min_tokens cut a verify step's accepted tokens where one token at a time
would have stopped, and grammars mask every drafted position (their matcher advanced through
the drafts and rolled back), on the shipped model."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.engine.core.sampling_params import StructuredOutputs
from tests.spec_helpers import scripted_llm

ASSETS = Path(__file__).parents[1] / "assets"
PROMPT = "Question: Tom has 13 apples and buys 24 more. How many apples does he have?\nAnswer:"
SCHEMA = (
    '{"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, '
    '"maximum": 999}, "unit": {"enum": ["apples", "pens"]}}, "required": ["answer", "unit"]}'
)


@pytest.fixture(scope="module")
def plain():
    return LLM(ASSETS, page_size=4)


def outputs_of(llm, params: list[SamplingParams]):
    return [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason)
        for o in llm.generate([PROMPT] * len(params), params)
    ]


def speculated(plain, params: list[SamplingParams], k: int = 3):
    """The outputs of a speculating engine whose drafts are each request's plain output with
    one wrong token moving through the positions."""
    reference = {}
    llm = scripted_llm(ASSETS, reference, k, page_size=4)
    for p, out in zip(params, plain.generate([PROMPT] * len(params), params)):
        reference[tuple(llm.tokenizer.encode(PROMPT))] = out.token_ids
        yield outputs_of(llm, [p])[0]


def test_stops_cut_accepted_drafts_where_plain_decoding_stops(plain):
    free = plain.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0]
    stop_text = plain.tokenizer.decode(free.token_ids[6:8])
    params = [
        SamplingParams(max_tokens=30, temperature=0, stop=[stop_text]),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[free.token_ids[5]]),
        SamplingParams(max_tokens=7, temperature=0),
        SamplingParams(
            max_tokens=30, temperature=0, min_tokens=12, stop_token_ids=[free.token_ids[5]]
        ),
        SamplingParams(
            max_tokens=30,
            temperature=0,
            logprobs=2,
            stop=[stop_text],
            include_stop_str_in_output=True,
        ),
    ]
    want = outputs_of(plain, params)
    assert list(speculated(plain, params)) == want
    assert want[0][2] == "stop" and want[2][2] == "length"


def test_grammars_mask_every_drafted_position(plain):
    after = plain.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))[0].token_ids[1:3]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=0,
            structured_outputs=StructuredOutputs(kind="json", spec=SCHEMA, after_token_ids=()),
        ),
        SamplingParams(
            max_tokens=24,
            temperature=0,
            structured_outputs=StructuredOutputs(
                kind="regex", spec=r" [0-9]+ apples?", after_token_ids=tuple(after)
            ),
        ),
    ]
    want = outputs_of(plain, params)
    assert list(speculated(plain, params)) == want
    assert want[0][1].startswith('{"answer": ')
