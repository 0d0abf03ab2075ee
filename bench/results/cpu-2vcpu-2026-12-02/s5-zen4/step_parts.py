import sys, time, tempfile, statistics, collections
from pathlib import Path
import torch
sys.path.insert(0, '.')
from bench import quantized as Q
from engine import LLM, SamplingParams
from engine.quantization.modules import QuantizedLinear
from kernels.linear import PackedLinear
from tests.quantize import quantize_checkpoint
model_dir = '/tmp/q41/m110'
acc = collections.defaultdict(float)
def timed(cls, key):
    f = cls.forward
    def g(self, *a, **k):
        t = time.perf_counter(); out = f(self, *a, **k); acc[key(self)] += time.perf_counter() - t
        return out
    cls.forward = g
timed(QuantizedLinear, lambda m: "quantized linears")
timed(PackedLinear, lambda m: "packed linears (lm_head)")
import engine.models.nemotron_h as nh
for name in dir(nh):
    obj = getattr(nh, name)
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and name.endswith(("Block", "Layer", "Mixer", "MLP", "Attention")):
        timed(obj, lambda m, n=name: f"{n} (incl.)")
with tempfile.TemporaryDirectory() as tmp:
    dirs = {"bf16": model_dir}
    for name in ("nvfp4",):
        dirs[name] = str(Path(tmp, name)); quantize_checkpoint(Path(model_dir), Path(dirs[name]), None, Q.FORMATS[name])
    llms = {n: LLM(d, dtype="bfloat16", max_running_requests=64) for n, d in dirs.items()}
    for r in range(3):
        for n, llm in llms.items():
            eng = llm.engine; step = eng.step; fwd = eng.runner.forward
            steps = []; fw = []
            def tstep():
                acc.clear(); t = time.perf_counter(); d = step(); steps.append((time.perf_counter() - t, dict(acc))); return d
            def tfwd(s):
                t = time.perf_counter(); o = fwd(s); fw.append(time.perf_counter() - t); return o
            eng.step = tstep; eng.runner.forward = tfwd
            llm.generate([list(range(5, 69))], [SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)])
            eng.step = step; eng.runner.forward = fwd
            dec = steps[2:]
            keys = sorted({k for _, a in dec for k in a})
            print(f"{n}: step {statistics.median([s for s, _ in dec])*1e3:.2f} ms, forward {statistics.median(fw[2:])*1e3:.2f} | " + ", ".join(f"{k} {statistics.median([a.get(k, 0) for _, a in dec])*1e3:.2f}" for k in keys), flush=True)
