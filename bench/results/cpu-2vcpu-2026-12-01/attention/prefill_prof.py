"""cProfile of 16 x 128-token prefill steps (max_tokens 1) on a random-weight config:
python prefill_prof.py CONFIG (3 timed steps, then 5 profiled)."""

import cProfile
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, "/work/main")
from bench.workloads import save_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

model_dir = tempfile.mkdtemp()
save_model(sys.argv[1], model_dir)
llm = LLM(
    model_dir,
    dtype="bfloat16",
    max_running_requests=64,
    max_num_batched_tokens=2048,
    chunked_prefill_size=1024,
)
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
generator = torch.Generator().manual_seed(0)


def run() -> float:
    ids = torch.randint(3, 1000, (16, 128), generator=generator).tolist()
    start = time.perf_counter()
    llm.generate(ids, [params] * 16)
    return time.perf_counter() - start


for _ in range(3):
    print("prefill", run())
profiler = cProfile.Profile()
profiler.enable()
for _ in range(5):
    run()
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
