"""How many CPU threads an engine process runs, set before torch starts in that process.

torch's intra-op pool and the C kernels (kernels/cpu/ops.c) run on libgomp's OpenMP threads,
which spin at every barrier before they sleep. When two engines share the same cores (`baton up`
puts a prefill and a decode worker on one machine), or anything else keeps them busy, a thread
spinning at a barrier holds a core that its team mate needs to finish: on the 2-vCPU VM the
moe100m offline run took 31-63 s instead of 3.4 s beside a second busy process. So each engine
on a shared machine gets its own share of the cores (one thread each on two cores: no barrier
at all).

Spinning itself stays: OMP_WAIT_POLICY=PASSIVE avoids the collapse (9-10 s in the run above) but
costs 20-50% when the team does own its cores (moe100m, alternated: fp32 3.9-4.4 s spinning vs
4.7-6.6 s passive; bf16 3.1-3.5 vs 4.1-4.7). A user who runs engines beside other busy work can
set it; their own OMP settings always win.

libgomp reads its settings once, when torch is loaded: they travel in the engine process's
environment, set by whoever starts it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def cores_per_engine(engines: int) -> int:
    """An equal share of this machine's cores for each of `engines` engines, at least one."""
    return max(1, available_cores() // max(1, engines))


def engine_environment(environ: Mapping[str, str], threads: int | None) -> dict[str, str]:
    """The environment of an engine process that runs `threads` CPU threads (None: torch's
    default, one per core). A user's own OMP_NUM_THREADS wins."""
    env = dict(environ)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {threads}")
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env
