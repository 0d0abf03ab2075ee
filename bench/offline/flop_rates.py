"""How close baton's steps and matmuls come to this machine's peak, for `baton.bench.offline.run`.

The peak is the better of `torch.mm` and the oneDNN-prepacked linear (kernels/linear.py) at
2048^3 in the model dtype; `decode_flop_fraction` and `prefill_flop_fraction` time whole engine
steps (2 x matmul params x tokens over the step time) and, with `baton.bench.offline.step_time.MatmulTimer`,
the matmuls alone.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch


def checkpoint_params(model_dir: str) -> int:
    """Parameters stored in a model directory's safetensors files, read from their headers
    (baton's prepacked linears hold theirs outside `parameters()`)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def active_matmul_params(model) -> int:
    """Parameters in baton's matmuls per token (routed experts: top_k of them)."""
    from baton.engine.layers.moe import Experts, SoftmaxTopKMoE
    from baton.kernels.linear import matmul_params

    active = matmul_params(model)
    for module in model.modules():
        if isinstance(module, Experts):
            per_expert = module.up_proj[0].numel() + module.down_proj[0].numel()
            active += module.top_k * per_expert
        elif isinstance(module, SoftmaxTopKMoE):
            per_expert = (
                module.input_linear.weight[0].numel() + module.output_linear.weight[0].numel()
            )
            active += module.top_k * per_expert
    return active


def _best_rate(fn, *args, repeats: int = 5) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return 2 * 2048**3 / best


def mm_peaks(dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of a 2048^3 matmul in `dtype`, by `torch.mm` and by the oneDNN-prepacked linear
    baton's CPU layers call (kernels/linear.py). They differ by machine: on a Zen 5 VM torch.mm's
    fp32 path reached 207-221 GFLOP/s and the prepacked one 475-493, so a fraction of torch.mm's
    rate alone read up to 175%."""
    from baton.kernels.linear import _packed_mm, can_pack

    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    peaks = {"torch.mm": _best_rate(torch.mm, a, b)}
    if can_pack(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
        peaks["onednn"] = _best_rate(_packed_mm, a, packed)
    return peaks


def machine_floor(llm, requests, peak_flops: float) -> dict:
    from baton.bench.offline.roofline import floor_seconds, memory_bandwidth, model_weights

    weights = model_weights(llm.engine.model, llm.engine.dtype)
    bandwidth = memory_bandwidth()
    return {
        **floor_seconds(weights, requests, peak_flops, bandwidth),
        "bandwidth_bytes_per_s": bandwidth,
        "peak_flops": peak_flops,
    }


def decode_flop_fraction(llm, batch: int = 64) -> dict:
    """Time steady decode steps at `batch` and compare 2 * params * batch FLOPs to the mm peak;
    then time the matmuls alone over 10 more steps (`matmul_fraction`: their rate to the peak)."""
    from baton import SamplingParams
    from baton.bench.offline.step_time import MatmulTimer

    engine = llm.engine
    for i in range(batch):
        engine.add_request(
            f"flop-{i}", [7 + i] * 64, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
    while any(r.num_remaining > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    with MatmulTimer(engine.model) as matmuls:
        for _ in range(10):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    # Best of 20 steps against the best of 5 torch.mm runs: the same statistic on both sides
    # (a noisy 2-core machine moves medians by +-5%); the median is reported too.
    step = min(times)
    params = active_matmul_params(engine.model)
    flops = 2 * params * batch / step
    peaks = mm_peaks(engine.dtype)
    peak = max(peaks.values())
    return {
        "mm_peaks_flops": peaks,
        "decode_step_ms": step * 1e3,
        "decode_step_median_ms": sorted(times)[len(times) // 2] * 1e3,
        "flops": flops,
        "mm_peak_flops": peak,
        "fraction": flops / peak,
        "matmul_flops": matmuls.rate(),
        "matmul_fraction": matmuls.rate() / peak,
    }


def prefill_flop_fraction(llm, peak: float, seqs: int = 16, prompt_len: int = 128) -> dict:
    """Time a prefill step of `seqs` x `prompt_len` tokens (one step of the side-by-side
    workload's prefill: 2048 batched tokens) and compare its matmul FLOPs (2 * params per token,
    the lm_head on the sampled rows only) to the mm peak. Best of 3, fresh ids each time (no
    prefix hits); `matmul_fraction`: the best rep's matmuls alone, to the peak."""
    from baton import SamplingParams
    from baton.bench.offline.step_time import MatmulTimer

    engine = llm.engine
    model = engine.model
    lm_head = model.lm_head.in_features * model.lm_head.out_features
    params = active_matmul_params(model)
    times, matmul_rates = [], []
    for rep in range(3):
        ids = torch.randint(
            3,
            min(1000, model.lm_head.out_features),
            (seqs, prompt_len),
            generator=torch.Generator().manual_seed(rep),
        )
        for i in range(seqs):
            engine.add_request(
                f"prefill-{rep}-{i}",
                ids[i].tolist(),
                SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            )
        with MatmulTimer(model) as matmuls:
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        matmul_rates.append(matmuls.rate())
        while engine.has_unfinished_requests():
            engine.step()
    step = min(times)
    flops = (2 * (params - lm_head) * seqs * prompt_len + 2 * lm_head * seqs) / step
    return {
        "prefill_step_ms": step * 1e3,
        "tokens": seqs * prompt_len,
        "flops": flops,
        "fraction": flops / peak,
        "matmul_flops": max(matmul_rates),
        "matmul_fraction": max(matmul_rates) / peak,
    }
