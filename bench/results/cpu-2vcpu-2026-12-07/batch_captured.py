import time, sys, tempfile
from baton import LLM, SamplingParams
from baton.bench.workloads import save_model
tmp = tempfile.mkdtemp(); save_model("110m", tmp)
eng = {"eager": LLM(tmp, dtype="bfloat16", cpu_step_capture=False), "captured": LLM(tmp, dtype="bfloat16")}
p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
for n in (8, 32):
    prompts = [[5 + i, 6, 7, 8 + i] * 8 for i in range(n)]
    best = {k: 0 for k in eng}
    for k, llm in eng.items(): llm.generate(prompts, p)
    for _ in range(3):
        for k, llm in eng.items():
            t = time.perf_counter(); llm.generate(prompts, p); dt = time.perf_counter() - t
            best[k] = max(best[k], n * 48 / dt)
    print(n, {k: round(v, 1) for k, v in best.items()}, "ratio", round(best["captured"] / best["eager"], 3), flush=True)
