"""The detokenizer stage: once per token, outside the engine's step loop, stop strings exact.

The oracle for text is `tokenizer.decode` of the whole output; the tokenizer is the byte-level
BPE of the shipped demo model (assets/), which splits CJK characters into single-byte tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from baton.engine.core.detokenizer import IncrementalDetokenizer, OutputDetokenizer
from baton.engine.core.outputs import RequestDelta

ASSETS = Path(__file__).parents[1] / "assets"
TEXTS = [
    "Tom has 3 apples and buys 4 more.",
    "naïve café, wörld: 日本語のテキスト ok",
    "emoji 🚀🚀 then ascii",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ASSETS))


def _delta(request_id: str, token: int, finished: bool = False, reason=None) -> RequestDelta:
    return RequestDelta(
        request_id=request_id,
        new_token_ids=[token],
        new_text="",
        new_logprobs=None,
        prompt_logprobs=None,
        finished=finished,
        finish_reason=reason,
        stop_reason=None,
        num_prompt_tokens=1,
        num_cached_tokens=0,
    )


def _stream(tokenizer, ids: list[int], stop: list[str], prompt=(5,)) -> list[RequestDelta]:
    """Feed `ids` one engine delta at a time (the last one finished by length)."""
    stage = OutputDetokenizer(tokenizer)
    stage.add_request("r", list(prompt), stop, True)
    out = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta = stage.process(_delta("r", token, last, "length" if last else None))
        if delta is not None:
            out.append(delta)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decoding_the_whole_output(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, [])
    assert "".join(d.new_text for d in deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d.new_text for d in deltas)


def test_multibyte_character_split_across_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("a日b", add_special_tokens=False)
    assert len(ids) == 5, "日 should be three single-byte tokens in this tokenizer"
    texts = [d.new_text for d in _stream(tokenizer, ids, [])]
    assert texts == ["a", "", "", "日", "b"]


def test_stop_string_spanning_tokens_ends_the_text_before_it(tokenizer):
    text = "Tom has 3 apples and buys 4 more."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # A stop string made of the last character of one token and the first of the next.
    boundary = next(i for i in range(3, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    stop = pieces[boundary - 1][-1] + pieces[boundary][len(pieces[boundary - 1])]
    assert stop not in pieces[boundary - 1] and text.index(stop) == len(pieces[boundary - 1]) - 1
    deltas = _stream(tokenizer, ids, ["zzz", stop])
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert deltas[-1].stop_reason == stop
    assert len(deltas) == boundary + 1, "the stop string ends it at the token completing it"
    # The stop's first character was held back while it could still grow into the stop.
    assert "".join(d.new_text for d in deltas) == text[: text.index(stop)]
    assert deltas[-2].new_text == "" or not deltas[-2].new_text.endswith(stop[0])


def test_stop_string_inside_a_multibyte_run(tokenizer):
    text = "x 日本語 y"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, ["本語"])
    assert "".join(d.new_text for d in deltas) == "x 日"
    assert deltas[-1].stop_reason == "本語"


def test_deltas_after_a_stop_are_dropped(tokenizer):
    stage = OutputDetokenizer(tokenizer)
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    stage.add_request("r", [5], ["a"], True)
    assert stage.process(_delta("r", ids[0])).finished  # the first token is "a"
    assert stage.process(_delta("r", ids[1])) is None


def test_a_token_id_stop_does_not_add_that_tokens_text(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    stage = OutputDetokenizer(tokenizer)
    stage.add_request("r", [5], [], False)
    texts = [stage.process(_delta("r", t)).new_text for t in ids[:-1]]
    last = stage.process(_delta("r", ids[-1], True, "stop"))
    assert "".join(texts) + last.new_text == tokenizer.decode(ids[:-1])


def test_each_token_is_decoded_once_without_re_decoding(tokenizer, monkeypatch):
    """The old detokenizer called tokenizer.decode twice per token; the stream calls it never
    (one Rust DecodeStream step per token) until a request ends mid-character."""
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or "")
    detok = IncrementalDetokenizer(tokenizer, [5, 6], [], True)
    for token in tokenizer.encode(TEXTS[1], add_special_tokens=False):
        detok.add(token)
    assert calls == []
    assert detok.take(final=True) == TEXTS[1]


def test_engine_step_does_no_detokenization(tiny_models, monkeypatch):
    """The step loop returns token ids only: it never even loads the tokenizer."""
    from baton.engine.core.engine import Engine
    from baton.engine.core.sampling_params import SamplingParams

    model_dir, _ = tiny_models("base")
    engine = Engine(model_dir, page_size=4)

    def refuse(*args, **kwargs):
        raise AssertionError("the engine step loop used the tokenizer")

    assert engine.lazy_tokenizer.available
    monkeypatch.setattr(engine.lazy_tokenizer, "get", refuse)
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True, stop=["a"]))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [d.new_text for d in deltas] == [""] * 4
    assert deltas[-1].finish_reason == "length"
