"""vLLM's recorded reasoning outputs (deepseek_r1, qwen3, nemotron_v3, and qwen3 with a
qwen3_coder call written inside the thinking), read by baton's parsers whole and streamed at
every chunking (tests/parser_cases.py). Each list names the peer file and commit, each case the
peer's test; expectations are the peer's non-streaming ones (where vLLM's streaming answer
differs, as for a newline before <think>, baton streams what it answers whole), except where a
comment says why baton answers otherwise.

Whether the output starts inside the thinking is baton's `thinking` (read from the prompt: the
template opened <think>, and enable_thinking was not false); vLLM's cases assume it started
there, so untagged output is reasoning, as current vLLM answers."""

from __future__ import annotations

import pytest

from tests.parser_cases import Case, check, output_parser

SECTION, REST = "This is a reasoning section", "This is the rest"

# vllm-project/vllm tests/reasoning/test_deepseekr1_reasoning_parser.py
# @ 04dbd8f32c4dc8ef1254eeaabd154a225948cf57
DEEPSEEK_R1 = [
    Case(
        name="simple_reasoning",
        text=f"{SECTION}</think>{REST}",
        reasoning=SECTION,
        content=REST,
    ),
    Case(name="complete_reasoning", text=f"{SECTION}</think>", reasoning=SECTION),
    Case(name="no_content_token", text="This is content", reasoning="This is content"),
    Case(
        name="multiple_lines",
        text="This\nThat</think>This is the rest\nThat",
        reasoning="This\nThat",
        content="This is the rest\nThat",
    ),
    Case(name="shortest", text=f"</think>{REST}", content=REST),
    Case(
        name="reasoning_with_think",
        text=f"<think>{SECTION}</think>{REST}",
        reasoning=SECTION,
        content=REST,
    ),
    Case(name="complete_reasoning_with_think", text=f"<think>{SECTION}</think>", reasoning=SECTION),
    Case(
        name="multiple_lines_with_think",
        text="<think>This\nThat</think>This is the rest\nThat",
        reasoning="This\nThat",
        content="This is the rest\nThat",
    ),
    Case(name="think_no_end", text=f"<think>{SECTION}", reasoning=SECTION),
    Case(name="empty", text=""),
    Case(  # vLLM's streaming keeps "\n" in the reasoning ("cannot handle"); baton streams this
        name="new_line",
        text=f"\n<think>{SECTION}</think>\n{REST}",
        reasoning=SECTION,
        content=f"\n{REST}",
    ),
]


@pytest.mark.parametrize("case", DEEPSEEK_R1, ids=lambda case: case.name)
def test_vllm_deepseek_r1_case_reads_the_same_whole_and_streamed(case):
    check(output_parser(None, "deepseek_r1"), case)


TOOL_CALL_BODY = (
    "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n"
    "</function>\n</tool_call>"
)
READ_FILE = "I need to read the file.\n\n"

# vllm-project/vllm tests/reasoning/test_qwen3_reasoning_parser.py
# @ 049d8df27dda4fd0caffa289ea12bfe5a47ac794 (reasoning parser alone: a call stays text)
QWEN3 = [
    Case(
        name="without_start_token",
        text=f"{SECTION}</think>{REST}",
        reasoning=SECTION,
        content=REST,
    ),
    Case(
        name="without_start_token_complete_reasoning", text=f"{SECTION}</think>", reasoning=SECTION
    ),
    Case(
        name="with_think", text=f"<think>{SECTION}</think>{REST}", reasoning=SECTION, content=REST
    ),
    Case(name="without_think", text=REST, reasoning=REST),  # thinking, cut before </think>
    Case(name="complete_reasoning", text=f"<think>{SECTION}</think>", reasoning=SECTION),
    Case(
        name="multiline_reasoning",
        text="<think>This is a reasoning\nsection</think>This is the rest\nThat",
        reasoning="This is a reasoning\nsection",
        content="This is the rest\nThat",
    ),
    Case(name="only_open_tag", text=f"<think>{SECTION}", reasoning=SECTION),
    Case(name="truncated_no_start_token", text=SECTION, reasoning=SECTION),
    Case(
        name="tool_call_no_think_end",
        text=READ_FILE + TOOL_CALL_BODY,
        reasoning=READ_FILE,
        content=TOOL_CALL_BODY,
    ),
    Case(
        name="tool_call_with_think_no_end",
        text="<think>" + READ_FILE + TOOL_CALL_BODY,
        reasoning=READ_FILE,
        content=TOOL_CALL_BODY,
    ),
    Case(
        name="start_and_end_in_one_delta_no_content",
        text="<think>reasoning</think>",
        reasoning="reasoning",
    ),
]


@pytest.mark.parametrize("case", QWEN3, ids=lambda case: case.name)
def test_vllm_qwen3_case_reads_the_same_whole_and_streamed(case):
    check(output_parser(None, "qwen3"), case)


# The same file, test_reasoning_thinking_disabled: enable_thinking false, all is the answer
QWEN3_NOT_THINKING = [
    Case(
        name="thinking_disabled_plain_content",
        text="This is plain content",
        content="This is plain content",
    ),
    Case(
        name="thinking_disabled_with_tool_call",
        text=READ_FILE + TOOL_CALL_BODY,
        content=READ_FILE + TOOL_CALL_BODY,
    ),
]


@pytest.mark.parametrize("case", QWEN3_NOT_THINKING, ids=lambda case: case.name)
def test_vllm_qwen3_case_without_thinking_reads_the_same_whole_and_streamed(case):
    check(output_parser(None, "qwen3", thinking=False), case)


# vllm-project/vllm tests/reasoning/test_nemotron_v3_reasoning_parser.py
# @ 028e77a725cd7c49766aa61a66abdcfc033d5bac: (thinking, case)
NEMOTRON_V3 = [
    (
        True,
        Case(
            name="without_start_token",
            text=f"{SECTION}</think>{REST}",
            reasoning=SECTION,
            content=REST,
        ),
    ),
    (
        True,
        Case(
            name="with_start_token",
            text=f"<think>{SECTION}</think>{REST}",
            reasoning=SECTION,
            content=REST,
        ),
    ),
    (
        False,
        Case(
            name="test_nemotron_v3_without_thinking_moves_into_content",
            text="This is plain content",
            content="This is plain content",
        ),
    ),
    (
        True,
        Case(
            name="test_nemotron_v3_with_thinking_keeps_truncated_reasoning",
            text="This is truncated reasoning",
            reasoning="This is truncated reasoning",
        ),
    ),
    (  # force_nonempty_content (vLLM moves this reasoning into the content) is not taken
        True,
        Case(
            name="test_nemotron_v3_force_nonempty_content_moves_into_content (declined)",
            text="<think>This is plain content",
            reasoning="This is plain content",
        ),
    ),
    (
        True,
        Case(
            name="test_nemotron_v3_force_nonempty_keeps_real_content",
            text="<think>reasoning here</think>real answer",
            reasoning="reasoning here",
            content="real answer",
        ),
    ),
]


@pytest.mark.parametrize(
    ("thinking", "case"), NEMOTRON_V3, ids=lambda item: getattr(item, "name", "")
)
def test_vllm_nemotron_v3_case_reads_the_same_whole_and_streamed(thinking, case):
    check(output_parser(None, "nemotron_v3", thinking=thinking), case)


FINISH = (
    "<tool_call>\n<function=Finish>\n<parameter=answer>\n204\n</parameter>\n</function>\n"
    "</tool_call>"
)
VERIFIED = (
    "The verification confirms my solution:\n- s = 2.5 km/h\n- t = 24 minutes\n"
    "- Total time at speed 3 km/h = 204 minutes\n\n"
)

# vllm-project/vllm tests/reasoning/test_qwen3_tool_call_recovery.py
# @ 50e9a157fa59b72ad3b91662dce21f15711a6762 (qwen3 reasoning, then qwen3_coder; no tools given)
RECOVERY = [
    Case(
        name="test_embedded_tool_call_is_promoted_from_reasoning_into_content",
        text="<think>" + VERIFIED + FINISH + "\n</think>",
        reasoning=VERIFIED,
        calls=(("Finish", {"answer": "204"}),),
    ),
    Case(
        name="test_existing_content_text_is_preserved_after_tool_call_promotion",
        text="<think>verify result\n" + FINISH + "</think>Here is the answer.",
        reasoning="verify result\n",
        content="Here is the answer.",
        calls=(("Finish", {"answer": "204"}),),
    ),
    Case(
        name="test_promoted_tool_call_is_parseable_by_qwen3coder_and_trailing_text_preserved",
        text="<think>verify result\n" + FINISH + "</think>assistant trailing text",
        reasoning="verify result\n",
        content="assistant trailing text",
        calls=(("Finish", {"answer": "204"}),),
    ),
    Case(
        name="test_truncated_reasoning_still_recovers_embedded_tool_call",
        text="verify result\n" + FINISH,
        reasoning="verify result\n",
        calls=(("Finish", {"answer": "204"}),),
    ),
    Case(
        name="test_normal_reasoning_extraction_unchanged",
        text="<think>Let me think about this carefully.\nThe answer is 42.</think>The answer is 42.",
        reasoning="Let me think about this carefully.\nThe answer is 42.",
        content="The answer is 42.",
    ),
    Case(
        name="test_post_think_content_preserved_without_tool_call",
        text="<think>some reasoning</think>plain response text",
        reasoning="some reasoning",
        content="plain response text",
    ),
]


@pytest.mark.parametrize("case", RECOVERY, ids=lambda case: case.name)
def test_vllm_qwen3_call_in_thinking_case_reads_the_same_whole_and_streamed(case):
    check(output_parser("qwen3_coder", "qwen3"), case)


def test_a_think_end_inside_a_value_after_an_interrupting_call_is_kept():
    """Only a </think> right after the call's </tool_call> closes the interrupted thinking."""
    text = FINISH.replace("204", "a </think> tag") + "\n</think>done"
    case = Case(
        name="baton",
        text="<think>x\n" + text,
        reasoning="x\n",
        content="\ndone",
        calls=(("Finish", {"answer": "a </think> tag"}),),
    )
    check(output_parser("qwen3_coder", "qwen3"), case)
