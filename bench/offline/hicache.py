"""TTFT of returning long conversations with the file tier vs without, and what its writes cost.

    python -m baton.bench.offline.hicache [--config 110m] [--tokens 4096] [--conversations 10]
        [--pool-conversations 2] [--track-interval 256] [--storage-dir DIR] [--threads N]
        [--output FILE]

Two engines with the same pools, sized to hold `--pool-conversations` conversations: "plain"
(prefix caching, no tier: evicted checkpoints are lost, issue 56's baseline) and "tier" (prefix
caching + --hicache-storage-backend file in a temporary directory). Each runs every conversation's
first turn, one after the other (the pools turn over), then every conversation comes back with a
new question: the median time to its first token is compared (goal: >= 5x on the CPU at 4k
tokens). Then the write cost: a saturating batch (`--batch` prompts of `--batch-tokens`, 64 new
tokens each) through pools small enough that blocks are evicted (and written) while it runs;
output tokens/s with the tier over without (goal: >= 0.95). Timings mean something only on an
idle machine.
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


def ttft(engine: Engine, prompt: list[int], rid: str, max_tokens: int = 1) -> tuple[float, list]:
    """Seconds to the first token of `prompt` alone, and its tokens (run to `max_tokens`)."""
    start, first, tokens = time.perf_counter(), None, []
    engine.add_request(
        rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if first is None and delta.new_token_ids:
                first = time.perf_counter() - start
            tokens += delta.new_token_ids
    return first, tokens


def throughput(engine: Engine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    start, produced = time.perf_counter(), 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}-{time.perf_counter_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        produced += sum(len(d.new_token_ids) for d in engine.step())
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="110m", choices=sorted(CONFIGS))
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of a conversation's history")
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--pool-conversations", type=int, default=2, help="what the pools hold")
    ap.add_argument("--track-interval", type=int, default=256, help="--mamba-track-interval")
    ap.add_argument("--batch", type=int, default=16, help="prompts of the throughput run")
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument(
        "--storage-dir",
        help="where the file tier writes (default: a temporary directory; ~2 GB at the defaults:"
        " /tmp may be memory)",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = CONFIGS[args.config]["vocab_size"]
    convs = [
        [rng.randrange(3, vocab) for _ in range(args.tokens)] for _ in range(args.conversations)
    ]
    questions = [[rng.randrange(3, vocab) for _ in range(32)] for _ in convs]
    interval = args.track_interval
    pools = dict(
        page_size=16,
        mamba_track_interval=interval,
        max_total_tokens=args.pool_conversations * (args.tokens + 256),
        max_mamba_slots=args.pool_conversations * (args.tokens // interval + 2) + 2,
    )
    result: dict = {"config": args.config, "tokens": args.tokens}
    with (
        tempfile.TemporaryDirectory() as model_dir,
        tempfile.TemporaryDirectory(dir=args.storage_dir) as store,
    ):
        save_model(args.config, model_dir)
        tier_args = dict(
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_dir=store,
        )
        engines = {
            "plain": Engine(model_dir, **pools),
            "tier": Engine(model_dir, **pools, **tier_args),
        }
        medians, outputs = {}, {}
        for name, engine in engines.items():
            ttft(engine, [5] * 32, f"{name}-warm-up")
            answers = [ttft(engine, c, f"{name}-a{i}", 8)[1] for i, c in enumerate(convs)]
            returning = [c + a + q for c, a, q in zip(convs, answers, questions)]
            runs = [ttft(engine, p, f"{name}-b{i}", 8) for i, p in enumerate(returning)]
            medians[name] = statistics.median(t for t, _ in runs)
            outputs[name] = [tokens for _, tokens in runs]
        tier_stats = engines["tier"].tier_stats()
        result |= {
            "ttft_plain_s": medians["plain"],
            "ttft_tier_s": medians["tier"],
            "ttft_speedup": medians["plain"] / medians["tier"],
            "same_outputs": outputs["plain"] == outputs["tier"],
            "file_hits": tier_stats["hicache:file:hits"],
            "file_load_s_per_block": tier_stats["hicache:file:load_seconds"]
            / max(1, tier_stats["hicache:file:hits"]),
        }
        for engine in engines.values():
            engine.close()

        # the write cost: evictions (and their writes) while a saturating batch runs
        batch, warm_up = (
            [[rng.randrange(3, vocab) for _ in range(args.batch_tokens)] for _ in range(args.batch)]
            for _ in range(2)
        )
        small = dict(pools, max_total_tokens=args.batch * (args.batch_tokens + 64) // 2)
        with tempfile.TemporaryDirectory(dir=args.storage_dir) as store2:
            rates = {}
            for name, extra in (
                ("plain", {}),
                ("tier", dict(tier_args, hicache_storage_dir=store2)),
            ):
                engine = Engine(model_dir, **small, **extra)
                throughput(engine, warm_up)  # the batch's shapes once (CPU plans), other prompts
                rates[name] = throughput(engine, batch)
                written = engine.tier_stats().get("hicache:file:writes", 0)
                engine.close()
        result |= {
            "tokens_per_s_plain": rates["plain"],
            "tokens_per_s_tier": rates["tier"],
            "throughput_ratio": rates["tier"] / rates["plain"],
            "blocks_written_during_batch": written,
        }
    print(
        f"{args.config}: {args.conversations} returning {args.tokens}-token conversations, pools "
        f"for {args.pool_conversations}: TTFT without tier {result['ttft_plain_s'] * 1e3:.0f} ms, "
        f"with the file tier {result['ttft_tier_s'] * 1e3:.0f} ms ({result['ttft_speedup']:.1f}x,"
        f" {result['file_hits']} blocks from files, same outputs: {result['same_outputs']}); "
        f"throughput under evictions {result['throughput_ratio']:.3f}x without the tier "
        f"({result['blocks_written_during_batch']} blocks written)"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
