"""Batch-1 decode of the shipped model and of the 110M NemotronH, eager and captured (issue 52).

    python -m baton.bench.offline.decode_step                 # shipped fp32 + 110M bf16, MTP k=2
    python -m baton.bench.offline.decode_step --rounds 5 --tokens 256 --output decode.json
    python -m baton.bench.offline.decode_step --prompt gsm8k   # a GSM8K prompt: real acceptance

One process loads each engine once per mode (eager: --enforce-eager's settings; captured: the
default CPU step plans), then alternates them for --rounds rounds of one greedy request of
--tokens new tokens (a fixed prompt, ignore_eos) and reports the best round of each. Prints:
- each model's tokens/s eager and captured, and captured / eager;
- the ratio the issue names: shipped model tokens/s over the 110M model's (both captured;
  the arithmetic alone would allow ~100x, the Python per step is what keeps it low);
- MTP k=2 with the shipped model's MTP layer over plain decoding, both captured, with whether
  the outputs were the same;
- the step breakdown of the captured runs (model, metadata, the drafter's passes, the rest of
  the host work: bench/offline/step_time.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def gsm8k_prompt() -> list[int]:
    """The first held-out GSM8K question after its 5 shots, as `baton eval gsm8k` asks it, in the
    shipped tokenizer's ids: text of the kind the shipped model (and its MTP layer) was trained
    on, where drafts are accepted as in use (the ids of PROMPT are not text)."""
    import json

    from transformers import PreTrainedTokenizerFast

    from baton.bench.accuracy.gsm8k import build_prompts
    from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH

    rows = [json.loads(line) for line in HELDOUT_PATH.read_text().splitlines() if line.strip()]
    text = build_prompts(rows, num_shots=5, num_questions=1)[0]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizer.json"))
    return tokenizer(text)["input_ids"]


def one_round(llm, prompt: list[int], tokens: int) -> tuple[float, list[int], dict]:
    from baton import SamplingParams
    from baton.bench.offline.step_time import StepTimer

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    with StepTimer(llm.engine) as timer:
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - start
    return tokens / elapsed, out.token_ids, timer.summary()


def alternate(
    engines: dict[str, object], prompt: list[int], rounds: int, tokens: int
) -> dict[str, dict]:
    """Best tokens/s of each engine over `rounds` alternated rounds (after one warm round)."""
    results = {name: {"tok_per_s": 0.0} for name in engines}
    for llm in engines.values():
        one_round(llm, prompt, tokens)  # records the plans, warms the caches
    for _ in range(rounds):
        for name, llm in engines.items():
            rate, token_ids, steps = one_round(llm, prompt, tokens)
            if rate > results[name]["tok_per_s"]:
                results[name] = {"tok_per_s": rate, "step_time": steps}
            results[name]["token_ids"] = token_ids
    return results


def main() -> None:
    from baton import LLM
    from baton.bench.workloads import save_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--big-dtype", default="bfloat16")
    parser.add_argument("--no-mtp", action="store_true")
    parser.add_argument(
        "--prompt",
        choices=["ids", "gsm8k"],
        default="ids",
        help="ids: 8 fixed token ids (not text); gsm8k: a 5-shot held-out GSM8K question, the"
        " text the shipped model and its MTP layer know (realistic draft acceptance)",
    )
    parser.add_argument("--output")
    args = parser.parse_args()

    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model("110m", tmp)
        engines = {
            "shipped eager": LLM(str(ASSETS), dtype="float32", cpu_step_capture=False),
            "shipped captured": LLM(str(ASSETS), dtype="float32"),
            "110m eager": LLM(tmp, dtype=args.big_dtype, cpu_step_capture=False),
            "110m captured": LLM(tmp, dtype=args.big_dtype),
        }
        if not args.no_mtp:
            engines["shipped captured mtp2"] = LLM(
                str(ASSETS),
                dtype="float32",
                speculative_config={"method": "mtp", "num_speculative_tokens": 2},
            )
        prompt = gsm8k_prompt() if args.prompt == "gsm8k" else PROMPT
        results = alternate(engines, prompt, args.rounds, args.tokens)
        if not args.no_mtp:  # tokens a verify row gains: 1 + its accepted drafts (vLLM's count)
            stats = engines["shipped captured mtp2"].stats()
            accepted = stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_drafts)
            report["mtp2_tokens_per_verify"] = 1 + accepted
    for name, row in results.items():
        steps = row["step_time"]
        print(
            f"{name:24s} {row['tok_per_s']:8.1f} tok/s  step {steps['step_ms']:.3f} ms: model "
            f"{steps['forward_ms']:.3f} ms ({steps['replayed_steps']} replayed), metadata "
            f"{steps['metadata_ms']:.3f} ms, draft passes {steps['draft_ms']:.3f} ms, other host "
            f"{steps['host_ms'] - steps['metadata_ms'] - steps['draft_ms']:.3f} ms",
            flush=True,
        )
    rate = {name: row["tok_per_s"] for name, row in results.items()}
    report["results"] = {
        n: {k: v for k, v in r.items() if k != "token_ids"} for n, r in results.items()
    }
    report["shipped_captured_over_eager"] = rate["shipped captured"] / rate["shipped eager"]
    report["110m_captured_over_eager"] = rate["110m captured"] / rate["110m eager"]
    report["shipped_over_110m_captured"] = rate["shipped captured"] / rate["110m captured"]
    report["shipped_over_110m_eager"] = rate["shipped eager"] / rate["110m eager"]
    for model in ("shipped", "110m"):
        same = results[f"{model} eager"]["token_ids"] == results[f"{model} captured"]["token_ids"]
        report[f"{model}_same_tokens"] = same
    if not args.no_mtp:
        report["mtp2_over_plain"] = rate["shipped captured mtp2"] / rate["shipped captured"]
        report["mtp2_same_tokens"] = (
            results["shipped captured mtp2"]["token_ids"]
            == results["shipped captured"]["token_ids"]
        )
    for key, value in report.items():
        if key != "results":
            print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
