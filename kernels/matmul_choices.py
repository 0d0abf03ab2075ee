"""MatmulChooser's timings (kernels/linear.py), kept per machine on disk like the C builds.

The chooser times each weight shape of a model at load (the matmul dtype of a bf16/fp16 model,
oneDNN vs baton's GEMM): a few hundred GEMM calls, 1-5 s of every engine start on a 2-core
machine, for answers that only change with the machine. The timings are kept in
`$BATON_CACHE_DIR/matmul-choices-<key>.json`, the key covering what they depend on: the CPU's
flags, the threads the engine runs, torch's version (its oneDNN), baton's GEMM source and the
timing rules. A timing on a busy machine is slower, never faster, than the truth, and one burst
of other work once made a worker pick the slower GEMM: so each start that times keeps the best
time of each form over every start so far, and the chooser decides on those; after
TRUSTED_SESSIONS starts a shape is settled and no longer timed. Delete the file to time again (or
force a choice with BATON_CPU_MATMUL_DTYPE / BATON_CPU_GEMM, which are never timed).

    {"<kind> <dtype> <in>x<out>": [best seconds of form A, of form B, starts that timed it]}

Two engines starting together (`baton up`) both time and both write; each write merges the
file's entries with its own, so neither loses the other's shapes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.machine_cache import cache_dir

log = logging.getLogger(__name__)

TRUSTED_SESSIONS = 2  # starts that time a shape before its best times are taken as they are

Entry = tuple[float, float, int]  # best seconds of the first form, of the second, sessions


def machine_key(threads: int, rules: str) -> str:
    """What a timing made here holds for; `rules` names the chooser's timing rules."""
    gemm_source = (Path(cpu_ops.__file__).parent / "gemm.c").read_bytes()
    parts = [cpu_ops.cpu_key(), str(threads), torch.__version__, rules]
    return hashlib.sha256("\n".join(parts).encode() + gemm_source).hexdigest()[:16]


class ChoiceCache:
    """The kept timings of one machine key, read at construction, written on every `record`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Entry] = self._read()

    @classmethod
    def for_this_machine(cls, rules: str) -> ChoiceCache:
        key = machine_key(torch.get_num_threads(), rules)
        return cls(cache_dir() / f"matmul-choices-{key}.json")

    def settled(self, key: str) -> tuple[float, float] | None:
        """The best times of both forms, once enough starts timed them (else None: time)."""
        entry = self.entries.get(key)
        return entry[:2] if entry is not None and entry[2] >= TRUSTED_SESSIONS else None

    def record(self, key: str, first_s: float, second_s: float) -> tuple[float, float]:
        """Keep this start's times; returns the best of each form over every start so far."""
        on_disk = self._read()  # the freshest: another engine may have timed since we read
        previous = on_disk.get(key) or self.entries.get(key)
        if previous is None:
            entry = (first_s, second_s, 1)
        else:
            entry = (min(previous[0], first_s), min(previous[1], second_s), previous[2] + 1)
        self.entries = self.entries | on_disk | {key: entry}
        self._write()
        return entry[:2]

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, suffix=".tmp", delete=False
            ) as file:
                json.dump(self.entries, file, indent=0, sort_keys=True)
            os.replace(file.name, self.path)  # atomic: a reader sees the old file or the new
        except OSError as error:  # a read-only cache: time again next start, as before
            log.warning("cannot keep the matmul timings in %s: %s", self.path, error)

    def _read(self) -> dict[str, Entry]:
        try:
            raw = json.loads(self.path.read_text())
            return {
                str(key): (float(first), float(second), int(sessions))
                for key, (first, second, sessions) in raw.items()
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as error:
            log.warning("ignoring unreadable matmul timings %s: %s", self.path, error)
            return {}
