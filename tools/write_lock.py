"""Write requirements.lock from a venv the suite passed in (`make upgrade-deps` runs it last).

    python tools/write_lock.py --venv .venv-upgrade --output requirements.lock

The lock is pip's constraints format: `name==version` for every package in the venv (pip
included, baton's own editable install and setuptools left out: setuptools comes with each venv
and pyproject's build requirement picks its own). torch loses its local label (`+cpu`) so that
the same line takes the CUDA build on a CUDA machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HEADER = """\
# The exact versions baton's suite last passed with: `make install` installs through this file
# (pip constraints: `-c requirements.lock`), so a newcomer's install does not move when an upstream
# package releases. `make upgrade-deps` re-resolves every dependency to its newest release in a
# fresh venv, runs the suite there, and rewrites this file only if the suite passes.
# Resolved on Linux x86-64, CPython 3.11. torch is pinned without a local label: `torch==2.13.0`
# takes the CPU build where one is served or on disk, the CUDA 12 build from PyPI's default index on
# a CUDA machine (its nvidia-* runtime packages are torch's own pins, not listed here).
"""


def lock_lines(frozen: str) -> list[str]:
    """`pip freeze --all --exclude-editable` output -> the lock's requirement lines."""
    lines = []
    for line in frozen.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("setuptools=="):
            continue
        if "==" not in line:
            raise SystemExit(f"write_lock: cannot pin {line!r} (not a released version)")
        name, version = line.split("==", 1)
        if name.lower() == "torch":
            version = version.split("+", 1)[0]
        lines.append(f"{name}=={version}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    python = args.venv / "bin" / "python"
    if not python.is_file():
        print(f"write_lock: no {python} (pass the venv the suite passed in)", file=sys.stderr)
        return 2
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    args.output.write_text(HEADER + "\n".join(lock_lines(frozen)) + "\n")
    print(f"write_lock: {args.output} from {args.venv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
