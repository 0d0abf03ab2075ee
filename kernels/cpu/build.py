"""Build every C kernel for this machine now: `python -m baton.kernels.cpu.build` (`make install` runs it).

Each kernel file is otherwise compiled on its first use (kernels/cpu/ops.py compile_library),
which put 8-28 s of compiling on a newcomer's first request on a busy 2-core machine. The
builds land in the same cache ($BATON_CACHE_DIR, keyed by source, flags, compiler and CPU), in
parallel. A build that fails (no compiler) is reported, as at run time, and the engine then
runs the torch path; it is not an installation error.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from baton.kernels.cpu.ops import compile_library

SOURCES = sorted(Path(__file__).parent.glob("*.c"))


def build_all(sources: list[Path] = SOURCES) -> dict[str, bool]:
    """Build (or find cached) each source; {file name: loaded}."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        loaded = pool.map(lambda source: compile_library(source, "torch path at run time"), sources)
        return {source.name: lib is not None for source, lib in zip(sources, loaded)}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    began = time.perf_counter()
    built = build_all()
    names = ", ".join(f"{name}{'' if ok else ' (failed)'}" for name, ok in built.items())
    print(f"C kernels ready in {time.perf_counter() - began:.1f} s: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
