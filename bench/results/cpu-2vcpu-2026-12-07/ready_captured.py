import time
from baton import LLM
for _ in range(3):
    for cap in (False, True):
        t = time.perf_counter(); LLM("/work/main/assets", dtype="float32", cpu_step_capture=cap); print("capture" if cap else "eager", round(time.perf_counter() - t, 3), flush=True)
