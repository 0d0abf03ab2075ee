"""How many CPU threads an engine process runs, set before torch starts in that process.

torch's intra-op pool and the C kernels (kernels/cpu_ops.c) run on libgomp's OpenMP threads,
which spin at every barrier before they sleep. When two engines share the same cores (`baton up`
puts a prefill and a decode worker on one machine), or anything else competes for them, a thread
spinning at a barrier holds a core that its team mate needs to finish: on the 2-vCPU VM a decode
step took 10x longer under a second busy process (bench/results/cpu-2vcpu-2026-11-30). So an
engine sharing the machine gets its own share of the cores, and a team whose threads cannot each
own a core waits passively instead of spinning.

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
    default, one per core). A user's own OMP settings win."""
    env = dict(environ)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {threads}")
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if threads < available_cores():
            # Other work owns the remaining cores: a spinning thread would steal them.
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env
