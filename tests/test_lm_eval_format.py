"""The shipped model scored the way lm-evaluation-harness's stock `gsm8k` task scores it (version 3.0
of its yaml: 5-shot "Question: …\\nAnswer:" prompts, greedy, stop sequences "Question:", "</s>",
"<|im_end|>", then its strict-match and flexible-extract filters and exact_match with its
regexes_to_ignore). lm-eval itself is not installed (it cannot download its data here); its rules
are restated below. A model that writes "Question." after `#### N` and rambles on passes
strict-match but fails flexible-extract: the stop sequence never fires and the last number in the
output is noise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from baton.bench.accuracy.gsm8k import build_prompts
from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH, read_jsonl

ASSETS = Path(__file__).parents[1] / "assets"
NUM_QUESTIONS = 48

LM_EVAL_UNTIL = ["Question:", "</s>", "<|im_end|>"]
LM_EVAL_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until tasks
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED = [",", r"\$", r"(?s).*#### ", r"\.$"]  # exact_match's regexes_to_ignore


def lm_eval_truncate(text: str) -> str:
    """lm-eval cuts a generation at its first stop sequence, whatever the server did."""
    for stop in LM_EVAL_UNTIL:
        text = text.split(stop)[0]
    return text


def regex_filter(pattern: re.Pattern, text: str, group_select: int) -> str:
    """lm-eval's RegexFilter followed by take_first."""
    matches = pattern.findall(text)
    if not matches:
        return "[invalid]"
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((group for group in match if group), "[invalid]")
    return match.strip()


def exact_match(prediction: str, reference: str) -> bool:
    for pattern in IGNORED:
        prediction = re.sub(pattern, "", prediction)
        reference = re.sub(pattern, "", reference)
    return prediction.strip().lower() == reference.strip().lower()


def test_lm_eval_rules_restated_here_behave_like_lm_eval():
    reference = "She has 3 + 4 = 7 apples.\n#### 1,007"
    good = " She has 3 + 4 = 7 apples.\n#### 1,007\n\n"
    rambling = " She has 3 + 4 = 7 apples.\n#### 1,007\n\nQuestion. Tom has 12 pens and 3 more"
    assert exact_match(regex_filter(STRICT, lm_eval_truncate(good), 0), reference)
    assert exact_match(regex_filter(FLEXIBLE, lm_eval_truncate(good), -1), reference)
    assert exact_match(regex_filter(STRICT, lm_eval_truncate(rambling), 0), reference)
    assert not exact_match(regex_filter(FLEXIBLE, lm_eval_truncate(rambling), -1), reference)
    assert regex_filter(FLEXIBLE, "no number", -1) == "[invalid]"


@pytest.fixture(scope="module")
def lm_eval_outputs():
    from baton import LLM, SamplingParams

    rows = read_jsonl(HELDOUT_PATH)
    prompts = build_prompts(rows, num_shots=5, num_questions=NUM_QUESTIONS)
    llm = LLM(str(ASSETS), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=LM_EVAL_MAX_GEN_TOKS, temperature=0, stop=LM_EVAL_UNTIL)
    outputs = [out.text for out in llm.generate(prompts, params)]
    return rows[5 : 5 + NUM_QUESTIONS], outputs


def test_shipped_model_stops_where_lm_eval_stops(lm_eval_outputs):
    """Every answer ends at lm-eval's stop sequence right after its `#### N` line: the model
    writes "\\n\\nQuestion:" there, as the few-shot examples do."""
    _, outputs = lm_eval_outputs
    stopped_after_answer = [re.search(r"#### -?[\d,.]+\s*$", text) is not None for text in outputs]
    assert sum(stopped_after_answer) >= 0.95 * len(outputs), [
        text for text, ok in zip(outputs, stopped_after_answer) if not ok
    ][:5]


def test_shipped_model_scores_alike_under_both_lm_eval_filters(lm_eval_outputs):
    rows, outputs = lm_eval_outputs
    scores = {}
    for name, pattern, group in (("strict-match", STRICT, 0), ("flexible-extract", FLEXIBLE, -1)):
        predictions = [regex_filter(pattern, lm_eval_truncate(text), group) for text in outputs]
        scores[name] = sum(
            exact_match(pred, row["answer"]) for pred, row in zip(predictions, rows)
        ) / len(rows)
    assert scores["strict-match"] >= 0.8, scores
    assert scores["flexible-extract"] >= 0.8, scores
    assert abs(scores["strict-match"] - scores["flexible-extract"]) <= 0.05, scores
