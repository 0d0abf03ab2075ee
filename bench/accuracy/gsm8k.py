"""GSM8K accuracy against any OpenAI-compatible server: `baton eval gsm8k`.

    baton eval gsm8k --base-url http://127.0.0.1:8000 --data bench/accuracy/data/gsm8k_synthetic_heldout.jsonl

The SGLang / lm-eval convention: the first `--num-shots` rows of the JSONL file are the few-shot
examples ("Question: …\\nAnswer: …" separated by blank lines), the next `--num-questions` rows
are asked after them ("Question: …\\nAnswer:"), greedy (temperature 0), generation stops at
"Question", and the last number of each output is compared with the number after "####" of the
row's answer (commas, `$` and a trailing period are ignored, a minus sign is kept).
With `--api chat` the shots are user/assistant turns (lm-eval's few-shot-as-multiturn).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Literal

from baton.bench.accuracy.gsm8k_client import STOP, OpenAIClient  # noqa: F401  (STOP is re-exported)

# A number as lm-eval's flexible extract sees it: an optional minus sign (not a hyphen between
# words or digits), an optional `$`, digits with thousands commas and an optional decimal part.
# A period that ends a sentence is not part of it ("is 5." gives 5).
_NUMBER = re.compile(r"(?:(?<![\w)\]])(-))?(?:\$(-)?)?(\d[\d,]*(?:\.\d+)?)")


def format_example(question: str, answer: str | None = None) -> str:
    """One shot ("Question: Q\\nAnswer: A") or, without an answer, the prompt's tail."""
    text = f"Question: {question}\nAnswer:"
    return text if answer is None else f"{text} {answer}"


def few_shot_prefix(rows: Sequence[dict]) -> str:
    return "".join(format_example(row["question"], row["answer"]) + "\n\n" for row in rows)


def build_prompts(rows: Sequence[dict], num_shots: int, num_questions: int) -> list[str]:
    """Prompts for rows[num_shots : num_shots + num_questions], each led by the first shots."""
    if len(rows) <= num_shots:
        raise ValueError(
            f"the data has {len(rows)} rows; --num-shots {num_shots} leaves no questions"
        )
    prefix = few_shot_prefix(rows[:num_shots])
    questions = rows[num_shots : num_shots + num_questions]
    return [prefix + format_example(row["question"]) for row in questions]


def build_chat_messages(
    rows: Sequence[dict], num_shots: int, num_questions: int
) -> list[list[dict]]:
    """The same few-shot prompts as chat turns (lm-eval's few-shot-as-multiturn): each shot is a
    user turn "Question: Q\\nAnswer:" and an assistant turn with its answer, then the question."""
    prompts = build_prompts(rows, num_shots, num_questions)  # validates the counts
    shots = []
    for row in rows[:num_shots]:
        shots += [
            {"role": "user", "content": format_example(row["question"])},
            {"role": "assistant", "content": row["answer"]},
        ]
    questions = rows[num_shots : num_shots + len(prompts)]
    return [
        shots + [{"role": "user", "content": format_example(row["question"])}] for row in questions
    ]


def parse_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


def extract_answer(output: str) -> Decimal | None:
    """The last number in a model's output, or None (an invalid answer) when it has none."""
    matches = _NUMBER.findall(output)
    if not matches:
        return None
    minus, minus_after_dollar, digits = matches[-1]
    value = parse_number(digits)
    return -value if value is not None and (minus or minus_after_dollar) else value


def reference_answer(answer: str) -> Decimal:
    """The number after "####" in a GSM8K answer."""
    if "####" not in answer:
        raise ValueError(f"answer has no '#### N' line: {answer[-80:]!r}")
    value = parse_number(answer.rsplit("####", 1)[1])
    if value is None:
        raise ValueError(f"no number after '####' in {answer[-80:]!r}")
    return value


def format_number(value: Decimal | None) -> str | None:
    if value is None:
        return None
    return str(int(value)) if value == value.to_integral_value() else str(value)


def score(
    rows: Sequence[dict],
    outputs: Sequence[str],
    latency_s: float,
    output_tokens: int,
    retried: int = 0,
    errors: Sequence[str | None] = (),
) -> dict:
    """The `--output` JSON: accuracy, invalid rate, latency, throughput, how many requests were
    retried and how many failed (a failed request has no output: it counts as wrong and stays in
    the denominator), and every question."""
    errors = list(errors) or [None] * len(rows)
    questions = []
    correct = invalid = 0
    for row, output, error in zip(rows, outputs, errors):
        pred = None if error else extract_answer(output)
        label = reference_answer(row["answer"])
        correct += pred == label
        invalid += pred is None
        questions.append(
            {
                "question": row["question"],
                "answer": format_number(label),
                "pred": format_number(pred),
                "output": output,
                **({"error": error} if error else {}),
            }
        )
    count = max(len(questions), 1)
    return {
        "accuracy": correct / count,
        "invalid": invalid / count,
        "latency_s": latency_s,
        "output_throughput": output_tokens / latency_s if latency_s > 0 else 0.0,
        "retried_requests": retried,
        "failed_requests": sum(error is not None for error in errors),
        "questions": questions,
    }


def run_eval(
    base_url: str,
    rows: Sequence[dict],
    *,
    num_shots: int = 5,
    num_questions: int = 200,
    parallel: int = 64,
    max_tokens: int = 512,
    api: Literal["completions", "chat"] = "completions",
    model: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
    retries: int = 4,
) -> dict:
    from tqdm import tqdm

    if api == "chat":
        requests = build_chat_messages(rows, num_shots, num_questions)
    else:
        requests = build_prompts(rows, num_shots, num_questions)
    asked = rows[num_shots : num_shots + len(requests)]
    client = OpenAIClient(base_url, api, model, max_tokens, parallel, api_key, retries=retries)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures = [pool.submit(client.complete, request) for request in requests]
            for _ in tqdm(
                as_completed(futures), total=len(futures), desc="gsm8k", disable=not progress
            ):
                pass
            completions = [future.result() for future in futures]
        latency_s = time.perf_counter() - start
    finally:
        client.close()
    return score(
        asked,
        [c.text for c in completions],
        latency_s,
        sum(c.completion_tokens for c in completions),
        retried=sum(c.retries > 0 for c in completions),
        errors=[c.error for c in completions],
    )


def summary(result: dict) -> str:
    return (
        f"Accuracy: {result['accuracy']:.3f}\n"
        f"Invalid: {result['invalid']:.3f}\n"
        f"Latency: {result['latency_s']:.3f} s\n"
        f"Output throughput: {result['output_throughput']:.3f} token/s\n"
        f"Retried requests: {result['retried_requests']}\n"
        f"Failed requests: {result['failed_requests']}"
    )


def add_eval_parser(subparsers) -> None:
    """`baton eval gsm8k ...` (registered by server/cli.py)."""
    import argparse

    evals = subparsers.add_parser(
        "eval",
        help="accuracy evals against an OpenAI-compatible server",
        description="Accuracy evals.",
    )
    kinds = evals.add_subparsers(title="evals", metavar="EVAL", required=True)
    parser = kinds.add_parser(
        "gsm8k",
        help="few-shot GSM8K (SGLang / lm-eval convention)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--data", required=True, help="GSM8K-format JSONL (question, answer)")
    parser.add_argument("--num-shots", type=int, default=5, help="few-shot rows (default: 5)")
    parser.add_argument(
        "--num-questions", type=int, default=200, help="questions asked (default: 200)"
    )
    parser.add_argument("--parallel", type=int, default=64, help="requests in flight (default: 64)")
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="tokens per answer (default: 512)"
    )
    parser.add_argument(
        "--api",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions (one few-shot prompt) or /v1/chat/completions (each shot a "
        "user turn and an assistant turn) (default: completions)",
    )
    parser.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument(
        "--retries",
        type=int,
        default=4,
        help="retries of a request answered 429 or 503 or whose connection dropped, with "
        "exponential backoff honouring Retry-After; a request that still fails counts as wrong "
        "and makes the command exit 1 (default: 4)",
    )
    parser.add_argument("--output", help="write the results JSON here")
    parser.set_defaults(handler=_run_gsm8k)


def _run_gsm8k(args) -> int:
    for name in ("num_shots", "num_questions", "parallel", "max_tokens", "retries"):
        if getattr(args, name) < (0 if name in ("num_shots", "retries") else 1):
            print(
                f"baton eval gsm8k: --{name.replace('_', '-')} is too small: {getattr(args, name)}",
                file=sys.stderr,
            )
            return 2
    import httpx

    from baton.bench.accuracy.gsm8k_data import read_jsonl

    try:
        rows = read_jsonl(args.data)
        result = run_eval(
            args.base_url,
            rows,
            num_shots=args.num_shots,
            num_questions=args.num_questions,
            parallel=args.parallel,
            max_tokens=args.max_tokens,
            api=args.api,
            model=args.model,
            api_key=args.api_key,
            retries=args.retries,
        )
    except (OSError, ValueError, RuntimeError, httpx.HTTPError) as error:
        print(f"baton eval gsm8k: {error}", file=sys.stderr)
        return 1
    print(summary(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    failed = [q for q in result["questions"] if "error" in q]
    if failed:
        print(
            f"baton eval gsm8k: {len(failed)} requests failed after {args.retries} retries "
            f"(counted as wrong); first: {failed[0]['error']}",
            file=sys.stderr,
        )
        return 1
    return 0
