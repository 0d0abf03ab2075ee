import sys, tempfile, time, cProfile, pstats
sys.path.insert(0, "/work/main")
import torch
from bench.workloads import save_model
from engine import LLM, SamplingParams
cfg = sys.argv[1]
d = tempfile.mkdtemp(); save_model(cfg, d)
llm = LLM(d, dtype="bfloat16", max_running_requests=64, max_num_batched_tokens=2048, chunked_prefill_size=1024)
sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
g = torch.Generator().manual_seed(0)
def run(rep):
    ids = torch.randint(3, 1000, (16, 128), generator=g).tolist()
    t = time.perf_counter(); llm.generate(ids, [sp] * 16); return time.perf_counter() - t
for r in range(3): print("prefill", run(r))
pr = cProfile.Profile(); pr.enable()
for r in range(5): run(r)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
