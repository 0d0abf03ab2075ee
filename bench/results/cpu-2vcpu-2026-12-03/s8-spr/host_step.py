"""The host's share of a decode step: the 110M config's 16-layer pattern at hidden 64 (every op
of the step, next to no arithmetic), batch 1, 64 new tokens x 5 requests; the engine step, the
model runner's forward (metadata + model + sampling) and the model's forward, in ms a step.
From the repository root: `python bench/results/cpu-2vcpu-2026-12-03/s8-spr/host_step.py
[bf16|fp8|nvfp4] [DIR]` (DIR: where the tiny checkpoints go, default /tmp/host_step)."""

import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, ".")
from baton import LLM, SamplingParams  # noqa: E402
from tests.quantize import quantize_checkpoint  # noqa: E402

FORMATS = {"fp8": "modelopt_fp8", "nvfp4": "modelopt_nvfp4"}


def main():
    fmt = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    root = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/host_step")
    base = root / "bf16"
    if not (base / "config.json").exists():
        config = transformers.NemotronHConfig(
            max_position_embeddings=8192, vocab_size=512, hidden_size=64,
            hybrid_override_pattern="M-M-M*-M-M-M*-M-", mamba_num_heads=4, mamba_head_dim=16,
            ssm_state_size=16, n_groups=2, chunk_size=32, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, intermediate_size=128, conv_kernel=4,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.NemotronHForCausalLM(config).save_pretrained(base)
    path = base
    if fmt != "bf16":
        path = root / fmt
        if not (path / "config.json").exists():
            quantize_checkpoint(base, path, None, FORMATS[fmt])
    llm = LLM(str(path), dtype="bfloat16", max_running_requests=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    seconds = {"engine step": 0.0, "runner forward": 0.0, "model forward": 0.0}
    steps = 0

    def timed(label, fn, count=False):
        def call(*args, **kwargs):
            nonlocal steps
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                steps += count

        return call

    llm.generate([[5, 6, 7, 8]], [params])  # warm-up
    engine.step = timed("engine step", engine.step, count=True)
    engine.runner.forward = timed("runner forward", engine.runner.forward)
    engine.model.forward = timed("model forward", engine.model.forward)
    for _ in range(5):
        llm.generate([[5, 6, 7, 8]], [params])
    for label, total in seconds.items():
        print(f"{label}: {1e3 * total / steps:.3f} ms a step")


if __name__ == "__main__":
    main()
