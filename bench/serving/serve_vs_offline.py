"""What the server path costs: `bench serve` against `baton serve` vs the offline engine, same
model, same engine settings, same batch, in one run.

    python -m baton.bench.serving.serve_vs_offline --config 110m --dtype bfloat16 [--rounds 2]

Random-weight model from `baton.bench.offline.run` (saved with a word-level tokenizer that covers the
whole vocabulary, so every sampled id has text and streams as its own chunk); workload: N
prompts x L random token ids, M new tokens, greedy, ignore_eos; the offline `LLM` and
`baton serve` get the same engine flags; the client sends all N at once (max concurrency N).
Prints both output tokens/s (median of the rounds, alternated) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from baton.bench.offline.peer import save_word_tokenizer
from baton.bench.serving.serve import BenchPrompt
from baton.bench.workloads import CONFIGS, save_model

ENGINE_FLAGS = {"max_running_requests": 64, "max_num_batched_tokens": 2048}


def offline_rate(model_dir: str, dtype: str, prompts: list[list[int]], new: int) -> float:
    from baton import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, **ENGINE_FLAGS)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def start_server(model_dir: str, dtype: str, port: int) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    command = [
        sys.executable,
        "-m",
        "baton.server.cli",
        "serve",
        "--model",
        model_dir,
        "--dtype",
        dtype,
    ]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "warning", *flags],
        cwd=Path(__file__).resolve().parents[2],
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"baton serve exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError("baton serve did not become healthy in 600 s")


def serve_rate(port: int, model_dir: str, prompts: list[list[int]], new: int) -> dict:
    """Every prompt at once (the offline engine's batch), through `bench serve`."""
    from baton.bench.serving.serve_side_by_side import run_rate

    requests = [BenchPrompt(prompt=p, prompt_len=len(p), output_len=new) for p in prompts]
    return run_rate(port, model_dir, requests, math.inf)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", choices=list(CONFIGS), default="110m")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--output")
    args = ap.parse_args()
    import random

    rng = random.Random(0)
    vocab = CONFIGS[args.config]["vocab_size"]
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)
    ]
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        save_word_tokenizer(model_dir, vocab)
        offline, served, summaries = [], [], []
        server = start_server(model_dir, args.dtype, args.port)
        try:
            for round_index in range(args.rounds):  # alternated: the machine's load drifts
                summary = serve_rate(args.port, model_dir, prompts, args.max_tokens)
                served.append(summary["output_throughput"])
                summaries.append(summary)
                offline.append(offline_rate(model_dir, args.dtype, prompts, args.max_tokens))
                print(
                    f"round {round_index}: serve {served[-1]:.1f} out tok/s "
                    f"(TTFT mean {summary['mean_ttft_ms']:.0f} ms), offline {offline[-1]:.1f}",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(60)
    ratio = statistics.median(served) / statistics.median(offline)
    print(
        f"[{args.config} {args.dtype}] serve {statistics.median(served):.1f} / offline "
        f"{statistics.median(offline):.1f} out tok/s = {ratio:.2f}"
    )
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {"args": vars(args), "serve": summaries, "offline": offline, "ratio": ratio},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
