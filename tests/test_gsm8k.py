"""GSM8K eval: answer extraction, prompt format, the synthetic generator and its held-out split,
and the shipped assets/ model scored through a live `baton serve`."""

from __future__ import annotations

import json
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

from baton.bench.accuracy.gsm8k import (
    build_chat_messages,
    build_prompts,
    extract_answer,
    format_number,
    reference_answer,
    run_eval,
    score,
)
from baton.bench.accuracy.gsm8k_data import (
    HELDOUT_PATH,
    HELDOUT_SEED,
    KINDS,
    NUM_FEW_SHOT_ROWS,
    generate,
    read_jsonl,
    split_of,
    take,
)
from tests.server_process import BATON, start_server

ASSETS = Path(__file__).parents[1] / "assets"
RESULT_KEYS = {
    "accuracy",
    "invalid",
    "latency_s",
    "output_throughput",
    "retried_requests",
    "failed_requests",
    "questions",
}


@pytest.mark.parametrize(
    "output, expected",
    [
        ("Tom has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("The total is 1,234,567 marbles.", "1234567"),
        ("It costs $1,000.", "1000"),
        ("The change is $12.50.", "12.50"),
        ("The answer is 42.", "42"),
        ("She ends with -8 points", "-8"),
        ("He owes -$5", "-5"),
        ("He owes $-5", "-5"),
        ("(-3)", "-3"),
        ("10 - 4 leaves 6", "6"),
        ("10 - 4", "4"),  # a binary minus is not a sign
        ("pages 5-9", "9"),  # nor is a hyphen between numbers
        ("first 12, then 30,", "30"),
        ("3.5.", "3.5"),
        ("Answer: 0", "0"),
    ],
)
def test_extract_answer_takes_the_last_number_like_lm_eval(output, expected):
    assert extract_answer(output) == Decimal(expected)


@pytest.mark.parametrize("output", ["", "I do not know.", "$ and , and ... and -", "#### "])
def test_output_without_a_number_is_invalid(output):
    assert extract_answer(output) is None


def test_reference_answer_reads_the_number_after_the_hashes():
    assert reference_answer("Natalia sold 48/2 = 24 clips.\n#### 1,072") == Decimal(1072)
    assert reference_answer("#### -5") == Decimal(-5)
    with pytest.raises(ValueError, match="####"):
        reference_answer("no final line 12")


def test_numbers_compare_by_value_not_by_spelling():
    assert extract_answer("costs $18.00.") == reference_answer("#### 18")
    assert format_number(Decimal("18.00")) == "18"
    assert format_number(Decimal("1E+1")) == "10"


def test_prompt_is_few_shot_rows_then_the_question():
    rows = [{"question": f"q{i}?", "answer": f"a{i}\n#### {i}"} for i in range(5)]
    prompts = build_prompts(rows, num_shots=2, num_questions=2)
    assert prompts == [
        "Question: q0?\nAnswer: a0\n#### 0\n\nQuestion: q1?\nAnswer: a1\n#### 1\n\nQuestion: q2?\nAnswer:",
        "Question: q0?\nAnswer: a0\n#### 0\n\nQuestion: q1?\nAnswer: a1\n#### 1\n\nQuestion: q3?\nAnswer:",
    ]
    assert len(build_prompts(rows, num_shots=2, num_questions=100)) == 3
    with pytest.raises(ValueError, match="num-shots"):
        build_prompts(rows, num_shots=5, num_questions=1)


def test_chat_messages_are_the_shots_as_turns_then_the_question():
    rows = [{"question": f"q{i}?", "answer": f"a{i}\n#### {i}"} for i in range(4)]
    assert build_chat_messages(rows, num_shots=1, num_questions=2) == [
        [
            {"role": "user", "content": "Question: q0?\nAnswer:"},
            {"role": "assistant", "content": "a0\n#### 0"},
            {"role": "user", "content": f"Question: q{i}?\nAnswer:"},
        ]
        for i in (1, 2)
    ]


def test_score_counts_correct_and_invalid_answers():
    rows = [{"question": "q", "answer": "#### 7"}] * 4
    result = score(rows, ["so 7.", "8", "none", "7,"], latency_s=2.0, output_tokens=10)
    assert set(result) == RESULT_KEYS
    assert result["accuracy"] == 0.5 and result["invalid"] == 0.25
    assert result["output_throughput"] == 5.0
    assert [q["pred"] for q in result["questions"]] == ["7", "8", None, "7"]


def test_generator_is_deterministic_per_seed_and_answers_are_right():
    first, again, other = take(3, 200), take(3, 200), take(4, 200)
    assert first == again
    assert first != other
    assert {p.kind for p in first} == set(KINDS)
    for problem in first:
        # The worked answer's last equation is the final answer, which is a positive integer.
        last_equation = problem.answer.split("\n")[0].rstrip(".").split("=")[-1]
        value = reference_answer(problem.answer)
        assert value > 0 and value == int(value)
        assert Decimal(last_equation.split()[0].lstrip("$")) == value


def test_heldout_file_is_the_generators_heldout_split():
    rows = read_jsonl(HELDOUT_PATH)
    assert len(rows) >= NUM_FEW_SHOT_ROWS + 200
    regenerated = take(HELDOUT_SEED, len(rows), "heldout", unique=True)
    assert rows == [p.row() for p in regenerated]
    assert all(split_of(p.key) == "heldout" for p in regenerated)
    assert len({p.key for p in regenerated}) == len(rows)


def test_training_never_draws_a_heldout_problem():
    heldout_keys = {p.key for p in take(HELDOUT_SEED, 205, "heldout", unique=True)}
    heldout_questions = {row["question"] for row in read_jsonl(HELDOUT_PATH)}
    for seed in (0, 1, HELDOUT_SEED):
        train = take(seed, 10_000, "train")
        assert all(split_of(p.key) == "train" for p in train)
        assert not heldout_keys & {p.key for p in train}
        assert not heldout_questions & {p.question for p in train}
    assert all(split_of(p.key) == "valid" for p in take(0, 500, "valid"))
    # The split is by problem, so a seed cannot leak: every kind has held-out and training keys.
    stream = generate(0, "heldout")
    assert {next(stream).kind for _ in range(500)} == set(KINDS)


@pytest.fixture(scope="module")
def shipped_server(tmp_path_factory):
    if not (ASSETS / "model.safetensors").is_file():
        pytest.fail(
            "assets/model.safetensors is missing: train it with `python -m baton.bench.accuracy.train_demo`"
        )
    server = start_server(ASSETS, tmp_path_factory.mktemp("gsm8k-server"))
    yield server
    server.stop()


def test_shipped_model_scores_at_least_0_8_through_baton_eval(shipped_server, tmp_path):
    output = tmp_path / "results.json"
    command = [
        str(BATON), "eval", "gsm8k", "--base-url", shipped_server.base_url,
        "--data", str(HELDOUT_PATH), "--num-questions", "20", "--parallel", "20",
        "--max-tokens", "128", "--output", str(output),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "Accuracy:" in finished.stdout
    result = json.loads(output.read_text())
    assert set(result) == RESULT_KEYS
    assert len(result["questions"]) == 20
    assert {"question", "answer", "pred", "output"} <= set(result["questions"][0])
    assert result["latency_s"] > 0 and result["output_throughput"] > 0
    assert result["accuracy"] >= 0.8, json.dumps(result["questions"], indent=1)
    # The server stopped at "Question": no output runs on into a next question.
    assert not any("Question" in q["output"] for q in result["questions"])


def test_chat_api_gives_the_same_answers_as_completions(shipped_server):
    rows = read_jsonl(HELDOUT_PATH)
    options = dict(num_questions=4, parallel=4, max_tokens=64, progress=False)
    chat = run_eval(shipped_server.base_url, rows, api="chat", **options)
    completions = run_eval(shipped_server.base_url, rows, api="completions", **options)
    assert set(chat) == RESULT_KEYS
    assert [q["output"] for q in chat["questions"]] == [
        q["output"] for q in completions["questions"]
    ]


def test_shipped_chat_template_renders_chat_shots_as_the_few_shot_prompt():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    rows = read_jsonl(HELDOUT_PATH)
    (messages,) = build_chat_messages(rows, num_shots=5, num_questions=1)
    (prompt,) = build_prompts(rows, num_shots=5, num_questions=1)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == prompt
    plain = [{"role": "user", "content": "Tom has 3 apples. How many?"}]
    assert tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == (
        "Question: Tom has 3 apples. How many?\nAnswer:"
    )


class ScriptedServer:
    """An OpenAI-like /v1/completions on 127.0.0.1 that answers from a script, one entry per
    request: an HTTP status (with `Retry-After: 0` on 429/503), "reset" (the connection is closed
    without an answer) or "ok" (a completion whose text is "#### 7")."""

    def __init__(self, script: list):
        import http.server
        import threading

        self.script = list(script)
        self.seen = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                step = outer.script.pop(0)
                outer.seen += 1
                if step == "reset":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status = 200 if step == "ok" else step
                payload = (
                    {"choices": [{"text": " #### 7"}], "usage": {"completion_tokens": 3}}
                    if status == 200
                    else {"error": {"message": f"scripted {status}"}}
                )
                data = json.dumps(payload).encode()
                self.send_response(status)
                if status in (429, 503):
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


ROWS = [{"question": f"q{i}?", "answer": "#### 7"} for i in range(4)]


def test_eval_retries_busy_and_unavailable_answers_and_dropped_connections():
    server = ScriptedServer([429, 503, "reset", "ok", "ok", "ok"])
    try:
        result = run_eval(
            server.url, ROWS, num_shots=1, num_questions=3, parallel=1, model="m", progress=False
        )
    finally:
        server.close()
    assert server.seen == 6 and not server.script
    assert result["accuracy"] == 1.0
    assert result["retried_requests"] == 1 and result["failed_requests"] == 0


def test_a_request_that_keeps_failing_counts_as_wrong_and_the_command_exits_1(tmp_path):
    from baton.server.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    # First question: 400 (not retried). Second: 503 three times (--retries 2). Third: answered.
    server = ScriptedServer([400, 503, 503, 503, "ok"])
    output = tmp_path / "result.json"
    try:
        status = main(
            ["eval", "gsm8k", "--base-url", server.url, "--data", str(data), "--num-shots", "1",
             "--parallel", "1", "--model", "m", "--retries", "2", "--output", str(output)]
        )  # fmt: skip
    finally:
        server.close()
    assert status == 1
    assert server.seen == 5
    result = json.loads(output.read_text())
    assert len(result["questions"]) == 3  # failures stay in the denominator
    assert result["accuracy"] == pytest.approx(1 / 3)
    assert result["failed_requests"] == 2 and result["retried_requests"] == 1
    assert "answered 400" in result["questions"][0]["error"]
    assert "answered 503" in result["questions"][1]["error"]
