import cProfile
import pstats
import sys
import tempfile
import time

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from bench.peer import save_word_tokenizer  # noqa: E402
from bench.workloads import save_model, workload
from engine import LLM, SamplingParams

cfg = sys.argv[1] if len(sys.argv) > 1 else "110m"
dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
d = tempfile.mkdtemp()
save_model(cfg, d)

try:
    from bench.workloads import CONFIGS

    save_word_tokenizer(d, CONFIGS[cfg]["vocab_size"])
except Exception as e:
    print("tok", e)
llm = LLM(
    d, dtype=dtype, max_running_requests=64, max_num_batched_tokens=2048, chunked_prefill_size=1024
)
reqs = workload(cfg, None, side_by_side=True)
params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
llm.generate([[5] * 16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
for _i in range(2):
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt = time.perf_counter() - t
    print("plain", sum(len(o.token_ids) for o in outs) / dt, "tok/s", dt)

with profile(activities=[ProfilerActivity.CPU]) as prof:
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt = time.perf_counter() - t
print("profiled", dt)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))

pr = cProfile.Profile()
pr.enable()
outs = llm.generate([p for p, _ in reqs], params)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
