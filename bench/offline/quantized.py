"""One model's weights as bf16, FP8 and NVFP4 in the same run: decode tokens/s at a few batch
sizes and the bytes each decode step reads (`python -m baton.bench.offline.run --weights bf16,fp8,nvfp4`).

The FP8 and NVFP4 checkpoints are written from the bf16 one by tests/quantize.py as NVIDIA
ModelOpt ships them (every linear but the lm_head quantized, as ModelOpt leaves it; FP8 with one
scale per tensor, NVFP4 with e4m3 scales per 16 inputs) and served with --dtype bfloat16: the
activations and the lm_head stay bf16, the quantized linears run the weight-only C kernel.

A decode step streams every weight once (plus each sequence's recurrent state), so at batch 1
its time is bound by the bytes it reads; the bound on a quantized model's speed-up is
bf16 bytes / quantized bytes per step. Decode rates are timed over the steps whose batch is
all decode rows (host work included), the variants alternated round by round on a shared
machine and the median round kept; also the median of each round's ratio to the bf16 round beside
it (steadier when the machine's speed drifts) and a second bound that adds the recurrent state
each step reads and writes (2 x state bytes per sequence) to both sides: bytes a step moves
whatever the weights' format, which the weights-only bound leaves out.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from baton.engine.quantization.modules import QuantizedLinear
from baton.kernels.linear import PackedLinear

# --weights name -> tests/quantize.py format (None: the checkpoint as it is)
FORMATS = {"bf16": None, "fp8": "modelopt_fp8", "nvfp4": "modelopt_nvfp4"}
PROMPT_TOKENS = 16


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of every weight a decode step reads: packed linears (bf16 or quantized, scales
    included), the lm_head; routed experts are not counted (a step reads only its own)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += (
                module.packed.nbytes() if module.packed is not None else module.quantized.nbytes()
            )
        elif isinstance(module, PackedLinear):
            total += module.packed.numel() * module.packed.element_size()
        elif type(module) is nn.Linear:
            total += module.weight.numel() * module.weight.element_size()
    return total


def decode_rate(llm, batch: int, new_tokens: int, vocab: int, seed: int) -> float:
    """Output tokens/s over the all-decode steps of `batch` requests (host time included)."""
    from baton import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(batch)
    ]
    engine = llm.engine
    # Engine.forward: every step passes it, replayed (graph runner) or eager (runner)
    step, forward = engine.step, engine.forward
    modes: list[str] = []
    decode_s, decode_tokens = 0.0, 0

    def recording_forward(sched):
        modes.append(sched.mode)
        return forward(sched)

    def timed_step():
        nonlocal decode_s, decode_tokens
        start, before = time.perf_counter(), len(modes)
        deltas = step()
        if len(modes) > before and modes[-1] == "decode":
            decode_s += time.perf_counter() - start
            decode_tokens += sum(len(d.new_token_ids) for d in deltas)
        return deltas

    engine.step, engine.forward = timed_step, recording_forward
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, [params] * batch)
    finally:
        engine.step, engine.forward = step, forward
    return decode_tokens / decode_s


def run_weights(
    model_dir: str,
    vocab: int,
    weights: list[str],
    batches: list[int],
    new_tokens: int,
    rounds: int,
    capture: bool = True,
) -> dict:
    from baton import LLM
    from tests.quantize import quantize_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name in weights:
            fmt = FORMATS[name]
            if fmt is None:
                dirs[name] = model_dir
            else:
                dirs[name] = str(Path(tmp, name))
                quantize_checkpoint(Path(model_dir), Path(dirs[name]), None, fmt)
        llms = {
            name: LLM(d, dtype="bfloat16", max_running_requests=64, cpu_step_capture=capture)
            for name, d in dirs.items()
        }
        for llm in llms.values():
            decode_rate(llm, 2, 4, vocab, seed=0)  # warm-up
        rates: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in weights}
        for round_index in range(rounds):
            for batch in batches:
                for name, llm in llms.items():  # alternated: a burst of load hits every variant
                    rate = decode_rate(llm, batch, new_tokens, vocab, seed=round_index)
                    rates[name][batch].append(rate)
                    print(
                        f"  round {round_index} batch {batch} {name}: {rate:.1f} tok/s", flush=True
                    )
        result = {"batches": batches, "new_tokens": new_tokens, "rounds": rounds,
                  "captured": capture, "variants": {}}  # fmt: skip
        base = weights[0]
        for name, llm in llms.items():
            spec = llm.engine.state_spec
            result["variants"][name] = {
                "weight_bytes_per_step": weight_bytes_per_step(llm.engine.model),
                "state_bytes_per_sequence": spec.bytes_per_slot(),
                "decode_tok_per_s": {b: statistics.median(r) for b, r in rates[name].items()},
                "rounds_tok_per_s": {b: r for b, r in rates[name].items()},
            }
        bytes_base = result["variants"][base]["weight_bytes_per_step"]
        for row in result["variants"].values():
            row["byte_ratio_bound"] = bytes_base / row["weight_bytes_per_step"]
            row["speedup"] = {
                b: row["decode_tok_per_s"][b] / result["variants"][base]["decode_tok_per_s"][b]
                for b in batches
            }
            row["batch1_fraction_of_bound"] = row["speedup"][batches[0]] / row["byte_ratio_bound"]
            # Each round's ratio to the base run beside it (this VM's speed drifts between rounds)
            first = batches[0]
            pairs = zip(
                row["rounds_tok_per_s"][first], result["variants"][base]["rounds_tok_per_s"][first]
            )
            row["paired_speedup"] = statistics.median(q / b for q, b in pairs)
            # The recurrent state a step reads and writes (per sequence, any weight format)
            state = 2 * row["state_bytes_per_sequence"] * first
            row["state_inclusive_bound"] = (bytes_base + state) / (
                row["weight_bytes_per_step"] + state
            )
        return result


def print_weights(result: dict) -> None:
    batches = result["batches"]
    print(
        f"decode tok/s ({result['new_tokens']} new tokens, median of {result['rounds']} rounds); "
        "bytes a step reads: weights (+ recurrent state per sequence)"
    )
    for name, row in result["variants"].items():
        rates = "  ".join(
            f"b{b} {row['decode_tok_per_s'][b]:7.1f} (x{row['speedup'][b]:.2f})" for b in batches
        )
        print(
            f"  {name:>6}: {row['weight_bytes_per_step'] / 1e6:6.1f} MB "
            f"(+{row['state_bytes_per_sequence'] / 1e6:.1f} MB/seq), bound x{row['byte_ratio_bound']:.2f}"
            f" | {rates} | batch {batches[0]}: {row['batch1_fraction_of_bound']:.0%} of the bound"
            f" (paired rounds x{row['paired_speedup']:.2f}, "
            f"{row['paired_speedup'] / row['byte_ratio_bound']:.0%}; with the state read and "
            f"written: bound x{row['state_inclusive_bound']:.2f}, "
            f"{row['paired_speedup'] / row['state_inclusive_bound']:.0%})"
        )
