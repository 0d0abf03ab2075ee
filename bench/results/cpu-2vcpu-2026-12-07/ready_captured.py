"""Time to a ready LLM of the shipped model, eager vs captured (the warm-up records a plan)."""

import time

from baton import LLM

for _ in range(3):
    for capture in (False, True):
        start = time.perf_counter()
        LLM("assets", dtype="float32", cpu_step_capture=capture)
        print("capture" if capture else "eager", round(time.perf_counter() - start, 3), flush=True)
