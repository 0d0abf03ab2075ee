"""TTFT of a 5-shot prompt with a warm prefix cache vs cold, and prefill tokens saved.

    python -m baton.bench.offline.prefix_cache [--config 110m] [--shots 5] [--questions 8] [--threads N]

A few-shot prefix (the shots) is shared by every question. "Cold" runs each question on an engine
with prefix caching off; "warm" first runs one question so the prefix's blocks and Mamba
checkpoints are cached, then times the others. Both report the median time to the first token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from baton.bench.workloads import CONFIGS, save_model
from baton.engine.core.engine import Engine
from baton.engine.core.sampling_params import SamplingParams


def ttft(engine: Engine, prompt: list[int], rid: str) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        if engine.step():
            break
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="110m", choices=sorted(CONFIGS))
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--shot-tokens", type=int, default=200, help="tokens per few-shot example")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--track-interval", type=int, default=128, help="--mamba-track-interval")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = CONFIGS[args.config]["vocab_size"]
    prefix = [rng.randrange(3, vocab) for _ in range(args.shots * args.shot_tokens)]
    questions = [
        prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(30, 80))]
        for _ in range(args.questions + 1)
    ]
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        cold_engine = Engine(model_dir, enable_prefix_caching=False)
        warm_engine = Engine(
            model_dir, enable_prefix_caching=True, mamba_track_interval=args.track_interval
        )
        ttft(cold_engine, [5] * 32, "warmup")
        ttft(warm_engine, questions[0], "prime")  # caches the shared prefix
        cold = [ttft(cold_engine, q, f"c{i}") for i, q in enumerate(questions[1:])]
        warm = [ttft(warm_engine, q, f"w{i}") for i, q in enumerate(questions[1:])]
        stats = warm_engine.stats()
    result = {
        "prompt_tokens": statistics.mean(len(q) for q in questions[1:]),
        "ttft_cold_s": statistics.median(cold),
        "ttft_warm_s": statistics.median(warm),
        "speedup": statistics.median(cold) / statistics.median(warm),
        "prefill_tokens_saved": stats.prefix_cache_hit_tokens,
        "prefill_tokens_total": stats.prefix_cache_query_tokens,
        "track_interval": warm_engine.handover.track_interval,
    }
    print(
        f"{args.config}: {result['prompt_tokens']:.0f}-token {args.shots}-shot prompts, TTFT cold "
        f"{result['ttft_cold_s'] * 1e3:.0f} ms, warm {result['ttft_warm_s'] * 1e3:.0f} ms "
        f"({result['speedup']:.1f}x); prefill tokens saved {stats.prefix_cache_hit_tokens} of "
        f"{stats.prefix_cache_query_tokens} (track interval {result['track_interval']})"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
