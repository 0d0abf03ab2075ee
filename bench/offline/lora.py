"""Throughput of a batch mixing LoRA adapters vs the base model alone (issue 55's goal: >= 0.8x on
the CPU at rank 16).

    python -m baton.bench.offline.lora [--config 19m] [--batch 32] [--adapters 4] [--rank 16]
        [--prompt-len 64] [--new-tokens 32] [--threads N] [--output result.json]

Both runs generate the same greedy workload: "base" on an engine without LoRA, "lora" on an
engine with --enable-lora --max-loras <adapters> where the batch's requests cycle through the
adapters (each row its own adapter, all in one batch). The adapters are random PEFT-layout
directories written here (attention q/k/v/o, Mamba in_proj/out_proj, MLP up/down), so PEFT is not
needed. Prints output tokens per second of each and their ratio, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from baton.bench.workloads import CONFIGS, save_model
from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.lora.request import LoRARequest

TARGETS = re.compile(r"^(?:backbone|model)\.(layers\.\d+\.mixer\.(?:[qkvo]_proj|in_proj|out_proj|up_proj|down_proj))\.weight$")  # fmt: skip


def write_adapter(model_dir: Path, path: Path, rank: int, seed: int) -> None:
    """A PEFT-layout adapter on every targeted projection of the model, small random A and B."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as file:
        for name in file.keys():
            match = TARGETS.match(name)
            if match is None:
                continue
            out, inp = file.get_slice(name).get_shape()
            prefix = f"base_model.model.model.{match[1]}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj",
                                 "up_proj", "down_proj"]}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def throughput(llm: LLM, prompts, params, lora) -> float:
    llm.generate(prompts[:2], params, lora_request=None if lora is None else lora[:2])  # warm
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="19m", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = CONFIGS[args.config]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    common = dict(max_running_requests=args.batch, enable_prefix_caching=False)
    with tempfile.TemporaryDirectory() as root:
        model_dir = Path(root, "model")
        save_model(args.config, str(model_dir))
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(model_dir, Path(root, name), args.rank, seed=i)
        lora = [
            LoRARequest(names[i % len(names)], i % len(names) + 1, str(Path(root, names[i % len(names)])))
            for i in range(args.batch)
        ]  # fmt: skip
        base = throughput(LLM(model_dir, **common), prompts, params, None)
        adapted_llm = LLM(model_dir, enable_lora=True, max_loras=args.adapters,
                          max_lora_rank=args.rank, **common)  # fmt: skip
        adapted = throughput(adapted_llm, prompts, params, lora)
    result = {
        "config": args.config,
        "batch": args.batch,
        "adapters": args.adapters,
        "rank": args.rank,
        "base_tok_s": base,
        "lora_tok_s": adapted,
        "ratio": adapted / base,
    }
    print(
        f"{args.config}: batch {args.batch}, {args.adapters} adapters of rank {args.rank}: "
        f"{adapted:.0f} tok/s vs base {base:.0f} tok/s = {adapted / base:.2f}x"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
