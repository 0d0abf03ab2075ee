"""Keep Python's cyclic garbage collector off the objects a serving process made at start-up.

A serving process holds a few hundred thousand long-lived objects (torch, transformers, the
tokenizer, FastAPI's routes, a loaded model's modules). CPython's full (generation 2) collection
walks all of them: 82-261 ms in baton's server process, during which its event loop streams
nothing; one that ran while serving a 32-request burst on the 19M model took the burst's mean
time to first token from ~80 ms to 436 ms (bench/results/cpu-2vcpu-2026-12-01/issue21.md).
`gc.freeze()` once start-up is done moves them to a permanent generation that collections skip
(vLLM's API server and engine core do the same); what is allocated later is collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect start-up garbage once, then exempt every surviving object from later collections.
    Call it when the process has loaded everything it keeps and before it starts serving."""
    gc.collect()
    gc.freeze()
