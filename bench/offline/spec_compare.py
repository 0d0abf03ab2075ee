"""Speculative decoding against plain decoding on the same workload, at several batch sizes:
`python -m baton.bench.offline.run --model DIR --speculative-config '{...}'` runs it.

For each batch size b, two engines serve the same requests at most b at a time (max_running_
requests = b): one plain, one with the speculative config. They run back to back `rounds`
times (alternated, so a burst of load on a shared machine skews one round, not one side); the
figure is the median of the paired ratios of output tokens per second, with the mean
acceptance length (1 + accepted drafts / verify rows) of the speculating runs.

The gsm8k workload is the shipped model's own task: the held-out 5-shot prompts, greedy, each
answer `max_tokens` long (ignore_eos: the same work on both sides), so the drafts meet the text
the model was trained to write.
"""

from __future__ import annotations

import statistics
import time

from baton.bench.accuracy.gsm8k import build_prompts
from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH, read_jsonl

GSM8K_SHOTS = 5


def gsm8k_requests(tokenizer, num_requests: int, max_tokens: int) -> list[tuple[list[int], int]]:
    prompts = build_prompts(read_jsonl(HELDOUT_PATH), GSM8K_SHOTS, num_requests)
    return [(tokenizer.encode(p), max_tokens) for p in prompts]


def _timed(llm, requests) -> tuple[float, int, int, int]:
    """(seconds, output tokens, verify rows, accepted drafts) of one generate."""
    from baton import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in requests]
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    return (
        seconds,
        sum(len(o.token_ids) for o in outs),
        after.spec_decode_num_drafts - before.spec_decode_num_drafts,
        after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
    )


def compare_speculation(
    model_dir: str,
    dtype: str,
    requests: list[tuple[list[int], int]],
    speculative_config: dict,
    batch_sizes: list[int],
    rounds: int,
) -> list[dict]:
    from baton import LLM

    results = []
    for batch in batch_sizes:
        engines = {
            "plain": LLM(model_dir, dtype=dtype, max_running_requests=batch),
            "speculative": LLM(
                model_dir,
                dtype=dtype,
                max_running_requests=batch,
                speculative_config=speculative_config,
            ),
        }
        for llm in engines.values():
            _timed(llm, requests[:1])  # warm-up: kernels built, buffers grown
        pairs, drafts, accepted = [], 0, 0
        for _ in range(rounds):
            plain_s, plain_tokens, _, _ = _timed(engines["plain"], requests)
            spec_s, spec_tokens, verify_rows, kept = _timed(engines["speculative"], requests)
            drafts, accepted = drafts + verify_rows, accepted + kept
            pairs.append((plain_tokens / plain_s, spec_tokens / spec_s))
        row = {
            "batch_size": batch,
            "requests": len(requests),
            "plain_tok_per_s": round(statistics.median(p for p, _ in pairs), 1),
            "speculative_tok_per_s": round(statistics.median(s for _, s in pairs), 1),
            "ratio": round(statistics.median(s / p for p, s in pairs), 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "rounds": [{"plain": round(p, 1), "speculative": round(s, 1)} for p, s in pairs],
        }
        print(
            f"[speculation b={batch}] plain {row['plain_tok_per_s']:.0f} out tok/s, "
            f"speculative {row['speculative_tok_per_s']:.0f}: {row['ratio']:.2f}x "
            f"(median of {rounds} alternated rounds); mean acceptance length "
            f"{row['mean_acceptance_length']}",
            flush=True,
        )
        results.append(row)
        for llm in engines.values():
            llm.close()
    return results
