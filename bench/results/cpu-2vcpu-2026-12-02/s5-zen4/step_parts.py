"""Where a batch-1 decode step's time goes, bf16 vs NVFP4 weights of the 110M model: module
forward times (inclusive) per decode step, medians over 126 steps, 3 alternated rounds.
Run from the repository root: `python bench/results/cpu-2vcpu-2026-12-02/s5-zen4/step_parts.py`
(the model directory: baton.bench.workloads.save_model("110m", MODEL_DIR))."""

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
import baton.engine.models.nemotron_h as nemotron_h  # noqa: E402
from baton import LLM, SamplingParams  # noqa: E402
from baton.bench.offline.run import quantized  # noqa: E402
from baton.engine.quantization.modules import QuantizedLinear  # noqa: E402
from baton.kernels.linear import PackedLinear  # noqa: E402
from tests.quantize import quantize_checkpoint  # noqa: E402

MODEL_DIR = "/tmp/q41/m110"
PARTS: dict[str, float] = collections.defaultdict(float)


def timed(cls: type, key: str) -> None:
    """Add the time of every `cls.forward` call to PARTS[key]."""
    forward = cls.forward

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        out = forward(self, *args, **kwargs)
        PARTS[key] += time.perf_counter() - start
        return out

    cls.forward = wrapper


def decode_parts(llm) -> tuple[float, float, dict[str, float]]:
    """(step, forward, {part: seconds}) medians over one request's decode steps."""
    engine = llm.engine
    step, forward = engine.step, engine.runner.forward
    steps: list[tuple[float, dict[str, float]]] = []
    forwards: list[float] = []

    def timed_step():
        PARTS.clear()
        start = time.perf_counter()
        deltas = step()
        steps.append((time.perf_counter() - start, dict(PARTS)))
        return deltas

    def timed_forward(sched):
        start = time.perf_counter()
        out = forward(sched)
        forwards.append(time.perf_counter() - start)
        return out

    engine.step, engine.runner.forward = timed_step, timed_forward
    try:
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        llm.generate([list(range(5, 69))], [params])
    finally:
        engine.step, engine.runner.forward = step, forward
    decode = steps[2:]  # past the prefill step
    keys = sorted({k for _, parts in decode for k in parts})
    medians = {k: statistics.median(parts.get(k, 0.0) for _, parts in decode) for k in keys}
    return statistics.median(s for s, _ in decode), statistics.median(forwards[2:]), medians


def main() -> None:
    timed(QuantizedLinear, "quantized linears")
    timed(PackedLinear, "packed linears (lm_head)")
    for name in dir(nemotron_h):
        obj = getattr(nemotron_h, name)
        layer_names = ("Block", "Layer", "Mixer", "MLP", "Attention")
        if (
            isinstance(obj, type)
            and issubclass(obj, torch.nn.Module)
            and name.endswith(layer_names)
        ):
            timed(obj, f"{name} (incl.)")
    with tempfile.TemporaryDirectory() as tmp:
        nvfp4 = Path(tmp, "nvfp4")
        quantize_checkpoint(Path(MODEL_DIR), nvfp4, None, quantized.FORMATS["nvfp4"])
        llms = {
            name: LLM(str(path), dtype="bfloat16", max_running_requests=64)
            for name, path in (("bf16", MODEL_DIR), ("nvfp4", nvfp4))
        }
        for _ in range(3):
            for name, llm in llms.items():
                step_s, forward_s, parts = decode_parts(llm)
                listed = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items())
                print(
                    f"{name}: step {step_s * 1e3:.2f} ms, forward {forward_s * 1e3:.2f} | {listed}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
