"""Decode step latency: eager vs CUDA graphs, against the HBM roofline (GPU); eager vs the
padded runner on the CPU is `python -m baton.bench.offline.run --compare-padded`.

    python -m baton.bench.offline.decode_graphs [--batches 1,2,4,8,16,32,64,128,256] [--max-model-len 131072]

Random bf16 weights at Nemotron-Nano-9B-v2 shapes. The roofline is the bytes one decode step must
read (weights + each sequence's KV + Mamba state read and written) over the peak bandwidth
(--peak-gbps, default H200's 4800 GB/s). The graphs are captured with the key capacity the server
uses (`--max-model-len`, default Nano-9B-v2's 131072), not just the context, so the per-step
metadata cost is the served one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each sequence")
    ap.add_argument("--peak-gbps", type=float, default=4800.0)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=131072,
        help="the server's capacity: the graphs' static key width (default: 131072)",
    )
    ap.add_argument("--output")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "baton.bench.offline.decode_graphs needs CUDA; on the CPU use: python -m baton.bench.offline.run --compare-padded"
        )
        return
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from baton.engine.cache.pools import StateCache
    from baton.engine.executor.forward_metadata import ScheduledBatch
    from baton.engine.executor.graph_runner import DecodeGraphRunner
    from baton.engine.executor.model_runner import ModelRunner
    from tests.gpu.test_graph_runner_gpu import NANO_LIKE

    batches = [int(b) for b in args.batches.split(",")]
    config_json = dict(
        NANO_LIKE,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    )
    rows = []
    # Built on the GPU directly: saving and loading a 9B checkpoint would take minutes.
    from baton.engine.config import ModelConfig
    from baton.engine.models.nemotron_h import NemotronHForCausalLM
    from baton.engine.models.registry import model_state_spec
    from tests.gpu.test_graph_runner_gpu import init_random_

    with torch.device("cuda"):
        model = NemotronHForCausalLM(ModelConfig.from_dict(config_json)).to(torch.bfloat16)
    init_random_(model)
    model.eval().requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    page = 16
    max_b = max(batches)
    pages_per_seq = (args.context + 16) // page + 1
    spec = model_state_spec(model.config, torch.bfloat16)
    cache = StateCache(
        spec,
        num_pages=max_b * pages_per_seq + 1,
        page_size=page,
        num_slots=max_b + 1,
        device="cuda",
    )
    eager = ModelRunner(model, cache, "cuda")
    graphed = DecodeGraphRunner(
        eager,
        max_bs=max_b,
        kv_capacity=-(-max(args.max_model_len, pages_per_seq * page) // page) * page,
        capture="cuda",
        verify_width=None,
    )
    state_bytes = spec.bytes_per_slot() * 2 + spec.bytes_per_token() * args.context
    for b in batches:
        sched = ScheduledBatch(
            mode="decode",
            request_ids=tuple(str(i) for i in range(b)),
            num_decode_seqs=b,
            num_verify_seqs=0,
            input_ids=(5,) * b,
            seq_lens=(1,) * b,
            start_positions=(args.context,) * b,
            kv_pages=tuple(
                tuple(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(b)
            ),
            mamba_slots=tuple(range(1, b + 1)),
            verify_slots=(),
            logits_seqs=tuple(range(b)),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=False,
            track_points=(),
            lora_slots=(-1,) * len(tuple(str(i) for i in range(b))),
        )
        timings = {}
        for name, run in (("eager", eager.forward), ("graph", graphed.forward)):
            for _ in range(3):
                run(sched)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                run(sched)
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - start) / 10
        roofline = (weight_bytes + b * state_bytes) / (args.peak_gbps * 1e9)
        row = {
            "batch": b,
            "eager_ms": timings["eager"] * 1e3,
            "graph_ms": timings["graph"] * 1e3,
            "roofline_ms": roofline * 1e3,
            "graph_fraction_of_roofline": roofline / timings["graph"],
            "metadata_h2d_bytes_per_step": graphed.buffers.last_copy_bytes,
        }
        rows.append(row)
        print(
            f"batch {b:4d}: eager {row['eager_ms']:7.2f} ms, graph {row['graph_ms']:7.2f} ms "
            f"({timings['eager'] / timings['graph']:.2f}x), roofline {row['roofline_ms']:6.2f} ms "
            f"({row['graph_fraction_of_roofline']:.0%}), metadata {row['metadata_h2d_bytes_per_step']} B "
            "copied per step",
            flush=True,
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
