"""bench/offline/roofline.py: the machine's floor for a workload, counted by hand on small cases."""

from __future__ import annotations

import pytest

from baton.bench.offline.roofline import Weights, floor_seconds


def test_dense_floor_counts_prefill_flops_and_bandwidth_bound_decode_steps():
    w = Weights(dense=100, head=10, expert=0, experts=0, top_k=0, bytes_per_weight=4)
    requests = [([1] * 5, 3), ([1] * 2, 2)]
    # prefill: 2*(5+2)*100 + 2*10 per request = 1400 + 40 FLOPs at 10 FLOP/s
    # decode steps 1 and 2: batches 2 and 1; compute 2*B*110 FLOPs, read 110*4 bytes at 100 B/s
    out = floor_seconds(w, requests, peak_flops=10.0, bandwidth=100.0)
    assert out["prefill_s"] == pytest.approx(144.0)
    assert out["decode_s"] == pytest.approx(max(44.0, 4.4) + max(22.0, 4.4))
    slow_memory = floor_seconds(w, requests, peak_flops=1e9, bandwidth=1.0)
    assert slow_memory["decode_s"] == pytest.approx(2 * 440.0)


def test_moe_decode_reads_the_experts_a_batch_touches():
    w = Weights(dense=0, head=0, expert=1000, experts=4, top_k=2, bytes_per_weight=1)
    # one token touches its 2 experts; two tokens touch 4 * (1 - (1/2)^2) = 3 on average
    one = floor_seconds(w, [([1], 2)], peak_flops=1e12, bandwidth=1.0)
    assert one["decode_s"] == pytest.approx(2000.0)
    two = floor_seconds(w, [([1], 2), ([1], 2)], peak_flops=1e12, bandwidth=1.0)
    assert two["decode_s"] == pytest.approx(3000.0)
    # prefill: each token uses k experts' weights
    assert two["prefill_s"] == pytest.approx(2 * 2 * 2000 / 1e12)
