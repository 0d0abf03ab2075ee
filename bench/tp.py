"""Tensor-parallel communication per decode step: the bytes rank 0 hands to all-reduces (and to
the logits gather) at TP=2, against the analytic count for the model, and the decode step time
at TP=2 against TP=1 in the same run.

    python -m bench.tp --config 19m --batch 8 --output tp.json

Analytic all-reduce bytes per rank per decode step (batch B, hidden h, model dtype of s bytes):
one (B, h) all-reduce for the embedding and one per layer (its row-parallel output), plus one
(B, 1) float32 per Mamba layer when n_groups == 1 (the gated norm's variance). Every rank hands
in the same bytes (the same layers reduce the same shapes); a ring all-reduce puts
2 (N-1) / N of them on the wire, as many as handed in at N = 2. The gather sends each rank's
vocabulary part of the logits, (B, V / N) in the model dtype, to rank 0.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from bench.workloads import CONFIGS, save_model
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def analytic_bytes(config: dict, batch: int, itemsize: int, tp: int) -> dict[str, int]:
    layers = len(config["hybrid_override_pattern"])
    mamba_layers = config["hybrid_override_pattern"].count("M")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    variance = mamba_layers * batch * 4 if config["n_groups"] == 1 and tp > 1 else 0
    return {
        "all_reduce_bytes": (1 + layers) * batch * hidden * itemsize + variance,
        "all_reduce_calls": 1 + layers + (mamba_layers if variance else 0),
        "gather_bytes": batch * (-(-vocab // tp)) * itemsize,
    }


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Prefill every prompt in one step, then time and count `steps` decode-only steps."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        )
    engine.step()  # the prefill (every prompt fits one step)
    tp = engine.ranks.tp if engine.ranks is not None else None
    before = (tp.all_reduce_bytes, tp.all_reduce_calls, tp.gather_bytes) if tp else (0, 0, 0)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    after = (tp.all_reduce_bytes, tp.all_reduce_calls, tp.gather_bytes) if tp else (0, 0, 0)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "step_ms": 1e3 * elapsed / steps,
        "all_reduce_bytes": (after[0] - before[0]) / steps,
        "all_reduce_calls": (after[1] - before[1]) / steps,
        "gather_bytes": (after[2] - before[2]) / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["19m", "110m", "moe100m"], default="19m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--output", help="write the figures as JSON here")
    args = ap.parse_args()
    config = CONFIGS[args.config]
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, config["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    results: dict = {"config": args.config, "batch": args.batch, "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        for size in (1, 2):
            with LLM(model_dir, dtype=args.dtype, tensor_parallel_size=size) as llm:
                decode_steps(llm, prompts, 4)  # warm-up: first-use costs (prepacking, caches)
                measured = decode_steps(llm, prompts, args.steps)
            results[f"tp{size}"] = measured
    expected = analytic_bytes(config, args.batch, itemsize, 2)
    results["analytic_tp2"] = expected
    results["all_reduce_bytes_ratio"] = (
        results["tp2"]["all_reduce_bytes"] / expected["all_reduce_bytes"]
    )
    results["gather_bytes_ratio"] = results["tp2"]["gather_bytes"] / expected["gather_bytes"]
    results["step_time_tp2_over_tp1"] = results["tp2"]["step_ms"] / results["tp1"]["step_ms"]
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
