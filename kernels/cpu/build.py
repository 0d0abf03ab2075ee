"""Build the C kernels for this machine now: `python -m baton.kernels.cpu.build` (`make install` runs it).

The kernels are one C++ extension (kernels/cpu/extension.py), otherwise compiled on its first
use, which put 30-60 s of compiling on a newcomer's first request on a busy 2-core machine. The
build lands in the same cache ($BATON_CACHE_DIR, keyed by the sources, flags, compilers, CPU
and torch). A build that fails (no compiler) is reported, as at run time, and the engine then
runs the torch paths; it is not an installation error.
"""

from __future__ import annotations

import logging
import sys
import time

from baton.kernels.cpu import extension


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    began = time.perf_counter()
    try:
        path = extension.build()
    except RuntimeError as error:
        print(f"C kernels not built (the torch paths will run): {error}")
        return 0
    found = extension.kernels(extension.sources())
    print(f"C kernels ready in {time.perf_counter() - began:.1f} s: {len(found)} kernels in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
