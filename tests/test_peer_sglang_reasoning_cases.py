"""SGLang's recorded reasoning-parser outputs, read by baton's reasoning parsers whole and
streamed at every chunking (tests/parser_cases.py); SGLang's chunked streaming tests are the
same texts, which every chunking covers.

SGLang's `force_reasoning` (the output starts inside the thinking, without <think>) is what
baton reads from the prompt as `thinking` (the template opened <think>); its Qwen3Detector and
Nemotron3Detector default to false, DeepSeekR1Detector to true. Where SGLang has a detector
baton lacks (its base detector), qwen3's rules stand in: they read the same tags."""

from __future__ import annotations

import pytest

from tests.parser_cases import Case, check, output_parser

ANSWER = "The answer is 42."

# sgl-project/sglang test/registered/unit/parser/test_reasoning_parser.py
# @ 0483dafc89605004524e941ff5d94a115012343f: (baton format, thinking, case)
CASES = [
    (
        "qwen3",
        False,
        Case(
            name="TestBase.test_detect_and_parse_normal_text",
            text="This is normal text",
            content="This is normal text",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBase.test_detect_and_parse_with_start_token",
            text="<think>This is reasoning",
            reasoning="This is reasoning",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBase.test_detect_and_parse_complete_reasoning",
            text="<think>This is reasoning</think>This is normal",
            reasoning="This is reasoning",
            content="This is normal",
        ),
    ),
    (
        "qwen3",
        True,
        Case(
            name="TestBase.test_detect_and_parse_force_reasoning",
            text="This should be reasoning",
            reasoning="This should be reasoning",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBase.test_parse_streaming_increment_mixed_content",
            text="<think>reasoning</think>normal",
            reasoning="reasoning",
            content="normal",
        ),
    ),
    (
        "deepseek_r1",
        True,
        Case(
            name="TestDeepSeekR1Detector.test_detect_and_parse_r1_format",
            text="I need to think about this. The answer is 42.",
            reasoning="I need to think about this. The answer is 42.",
        ),
    ),
    (
        "deepseek_r1",
        True,
        Case(
            name="TestDeepSeekR1Detector.test_detect_and_parse_with_end_token",
            text="I think this is the answer</think>The final answer is 42.",
            reasoning="I think this is the answer",
            content="The final answer is 42.",
        ),
    ),
    (
        "deepseek_r1",
        True,
        Case(
            name="TestDeepSeekR1Detector.test_detect_and_parse_with_start_token",
            text=f"<think>I need to think about this.</think>{ANSWER}",
            reasoning="I need to think about this.",
            content=ANSWER,
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestQwen3Detector.test_detect_and_parse_qwen3_format",
            text=f"<think>Let me think about this problem</think>{ANSWER}",
            reasoning="Let me think about this problem",
            content=ANSWER,
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestQwen3Detector.test_detect_and_parse_without_thinking",
            text="Direct answer without thinking.",
            content="Direct answer without thinking.",
        ),
    ),
    (
        "qwen3",
        True,
        Case(
            name="TestQwen3ForcedReasoningDetector.test_detect_and_parse_qwen3_forced_reasoning_format",
            text=f"I need to think about this step by step.</think>{ANSWER}",
            reasoning="I need to think about this step by step.",
            content=ANSWER,
        ),
    ),
    (
        "qwen3",
        True,
        Case(
            name="TestQwen3ForcedReasoningDetector.test_detect_and_parse_with_start_token",
            text=f"<think>I need to think about this.</think>{ANSWER}",
            reasoning="I need to think about this.",
            content=ANSWER,
        ),
    ),
    (
        "nemotron_v3",
        False,
        Case(
            name="TestNemotron3Detector.test_detect_and_parse_complete_reasoning",
            text=f"<think>Let me think about this</think>{ANSWER}",
            reasoning="Let me think about this",
            content=ANSWER,
        ),
    ),
    (
        "nemotron_v3",
        False,
        Case(
            name="TestNemotron3Detector.test_detect_and_parse_no_thinking",
            text="Direct answer without thinking.",
            content="Direct answer without thinking.",
        ),
    ),
    (  # force_nonempty_content would move it into the content: not taken (a stream cannot
        # take back the reasoning it sent); SGLang's swap tests are declined alike
        "nemotron_v3",
        False,
        Case(
            name="TestNemotron3Detector.test_detect_and_parse_reasoning_only",
            text="<think>All reasoning, no answer</think>",
            reasoning="All reasoning, no answer",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestReasoningParser.test_parse_non_stream_preserves_payload_whitespace",
            text="<think>\nLet me think\n</think>\n\nThe answer is 42.\n",
            reasoning="\nLet me think\n",
            content="\n\nThe answer is 42.\n",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestReasoningParser.test_parse_non_stream_strips_repeated_leading_start_tokens",
            text=f"<think><think>Let me think</think>{ANSWER}",
            reasoning="Let me think",
            content=ANSWER,
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestIntegrationScenarios.test_empty_reasoning_blocks",
            text="<think></think>Just the answer.",
            content="Just the answer.",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestIntegrationScenarios.test_qwen3_streaming_scenario",
            text="<think>Let me analyze this problem. I need to consider multiple factors.</think>"
            "Based on my analysis, the solution is to use a different approach.",
            reasoning="Let me analyze this problem. I need to consider multiple factors.",
            content="Based on my analysis, the solution is to use a different approach.",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBufferLossBugFix.test_partial_end_tag_buffer_loss_bug",
            text="</answer",
            content="</answer",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBufferLossBugFix.test_partial_start_tag_buffer_preservation",
            text="<this is text",
            content="<this is text",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBufferLossBugFix.test_multiple_partial_fragments",
            text="</random>",
            content="</random>",
        ),
    ),
    (
        "qwen3",
        False,
        Case(
            name="TestBufferLossBugFix.test_partial_end_tag_in_reasoning_mode",
            text="<think>some reasoning</think>normal text",
            reasoning="some reasoning",
            content="normal text",
        ),
    ),
]


@pytest.mark.parametrize(
    ("reasoning", "thinking", "case"), CASES, ids=lambda item: getattr(item, "name", "")
)
def test_sglang_reasoning_case_reads_the_same_whole_and_streamed(reasoning, thinking, case):
    check(output_parser(None, reasoning, thinking=thinking), case)
