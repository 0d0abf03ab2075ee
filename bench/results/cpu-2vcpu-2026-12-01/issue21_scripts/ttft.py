"""One 128-token prompt's prefill step (max_tokens=1), min and median of 7, on the tree on PYTHONPATH."""

import statistics
import sys
import tempfile
import time

import torch

from bench.workloads import save_model
from engine import LLM, SamplingParams

config, dtype = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as d:
    save_model(config, d)
    llm = LLM(
        d,
        dtype=dtype,
        max_running_requests=64,
        max_num_batched_tokens=2048,
        chunked_prefill_size=1024,
    )
    eng = llm.engine
    times = []
    for rep in range(8):
        ids = torch.randint(3, 1000, (128,), generator=torch.Generator().manual_seed(rep)).tolist()
        eng.add_request(
            f"t{rep}", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        )
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
    times = times[1:]
    print(
        f"TTFT-step {config} {dtype} [{sys.path[0] or '.'}]: min {min(times) * 1e3:.1f} ms median {statistics.median(times) * 1e3:.1f} ms"
    )
