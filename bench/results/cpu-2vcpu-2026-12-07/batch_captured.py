"""8 and 32 concurrent streams of the 110M bf16 model, eager vs captured, alternated."""

import tempfile
import time

from baton import LLM, SamplingParams
from baton.bench.workloads import save_model

tmp = tempfile.mkdtemp()
save_model("110m", tmp)
engines = {
    "eager": LLM(tmp, dtype="bfloat16", cpu_step_capture=False),
    "captured": LLM(tmp, dtype="bfloat16"),
}
params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
for n in (8, 32):
    prompts = [[5 + i, 6, 7, 8 + i] * 8 for i in range(n)]
    best = dict.fromkeys(engines, 0.0)
    for llm in engines.values():
        llm.generate(prompts, params)
    for _ in range(3):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts, params)
            best[name] = max(best[name], n * 48 / (time.perf_counter() - start))
    ratio = best["captured"] / best["eager"]
    print(n, {k: round(v, 1) for k, v in best.items()}, "ratio", round(ratio, 3), flush=True)
