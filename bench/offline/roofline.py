"""The fastest any engine could run a workload on this machine: its matmuls at the matmul peak,
each decode step no faster than reading the weights it touches at the measured memory bandwidth.

The floor bounds the ratio of two engines doing the same work: baton / transformers can be at
most `transformers seconds / floor seconds`. baton.bench.offline.run prints it beside the measured ratio,
so a target above the bound reads as what it is (out of reach on this machine for this workload),
and the share of the floor each engine reaches shows how much either leaves on the table.

Counts (T prompt tokens, B running requests at a decode step, P_dense the matmul weights every
token uses, lm_head excluded, P_head the lm_head's, routed experts: k of E per token, P_exp each):
  prefill FLOPs = 2 * T * (P_dense + k * P_exp) + 2 * P_head per request (its first token's logits)
  decode step   = max(2 * B * (P_dense + P_head + k * P_exp) / peak,
                      bytes(P_dense + P_head + E * (1 - (1 - k/E)^B) * P_exp) / bandwidth)
The expected number of distinct experts touched by B tokens assumes uniform routing (a trained
router's skew touches fewer: the floor is then a little high for MoE models, say so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Weights:
    dense: int  # matmul weights every token uses, lm_head excluded
    head: int  # lm_head
    expert: int  # one routed expert's matmul weights, summed over MoE layers
    experts: int  # routed experts per layer (0: dense model)
    top_k: int
    bytes_per_weight: int


def model_weights(model, dtype: torch.dtype) -> Weights:
    from baton.engine.layers.moe import Experts, SoftmaxTopKMoE
    from baton.kernels.linear import matmul_params

    config = model.config
    head = config.vocab_size * config.hidden_size
    expert = experts = top_k = 0
    for module in model.modules():
        if isinstance(module, Experts):
            expert += module.up_proj[0].numel() + module.down_proj[0].numel()
            experts, top_k = module.up_proj.shape[0], module.top_k
        elif isinstance(module, SoftmaxTopKMoE):
            expert += module.input_linear.weight[0].numel() + module.output_linear.weight[0].numel()
            experts, top_k = module.input_linear.weight.shape[0], module.top_k
    return Weights(
        dense=matmul_params(model) - head,
        head=head,
        expert=expert,
        experts=experts,
        top_k=top_k,
        bytes_per_weight=dtype.itemsize,
    )


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s a full-tensor read reaches (best of `repeats`), with torch's threads."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def floor_seconds(w: Weights, requests, peak_flops: float, bandwidth: float) -> dict:
    """requests: [(prompt ids, new tokens)]; every request decodes in one batch, as baton's
    scheduler runs them when they fit (the benchmark's workloads do)."""
    active = w.dense + w.top_k * w.expert
    prefill = sum(2 * len(p) * active + 2 * w.head for p, _ in requests) / peak_flops
    outputs = [o for _, o in requests]
    decode = 0.0
    for step in range(1, max(outputs)):
        batch = sum(o > step for o in outputs)
        touched = w.experts * (1 - (1 - w.top_k / w.experts) ** batch) if w.experts else 0
        read = (w.dense + w.head + touched * w.expert) * w.bytes_per_weight
        compute = 2 * batch * (active + w.head)
        decode += max(compute / peak_flops, read / bandwidth)
    return {"prefill_s": prefill, "decode_s": decode, "seconds": prefill + decode}
