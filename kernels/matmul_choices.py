"""MatmulChooser's timed choices (kernels/linear.py), kept per machine on disk like the C builds.

The chooser times each weight shape of a model at load (the matmul dtype of a bf16/fp16 model,
oneDNN vs baton's GEMM): a few hundred GEMM calls, 1-5 s of every engine start on a 2-core
machine, for answers that only change with the machine. They are kept in
`$BATON_CACHE_DIR/matmul-choices-<key>.json`, the key covering what the timings depend on: the
CPU's flags, the threads the engine runs, torch's version (its oneDNN), baton's GEMM source and
the timing rules. Delete the file to time again (or force a choice with BATON_CPU_MATMUL_DTYPE /
BATON_CPU_GEMM, which are never cached).

    {"<kind> <dtype> <in>x<out>": ["<choice>", seconds of form A, seconds of form B], ...}

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

from kernels import cpu_ops

log = logging.getLogger(__name__)

Entry = tuple[str, float, float]  # (choice, seconds of the first form, of the second)


def machine_key(threads: int, rules: str) -> str:
    """What a timing made here holds for; `rules` names the chooser's timing rules."""
    gemm_source = (Path(cpu_ops.__file__).parent / "cpu_gemm.c").read_bytes()
    parts = [cpu_ops.cpu_key(), str(threads), torch.__version__, rules]
    return hashlib.sha256("\n".join(parts).encode() + gemm_source).hexdigest()[:16]


class ChoiceCache:
    """The timed choices of one machine key, read at construction, written on every `put`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Entry] = self._read()

    @classmethod
    def for_this_machine(cls, rules: str) -> ChoiceCache:
        key = machine_key(torch.get_num_threads(), rules)
        return cls(cpu_ops.cache_dir() / f"matmul-choices-{key}.json")

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def put(self, key: str, entry: Entry) -> None:
        self.entries = self._read() | self.entries | {key: entry}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, suffix=".tmp", delete=False
            ) as file:
                json.dump(self.entries, file, indent=0, sort_keys=True)
            os.replace(file.name, self.path)  # atomic: a reader sees the old file or the new
        except OSError as error:  # a read-only cache: time again next start, as before
            log.warning("cannot keep the matmul choices in %s: %s", self.path, error)

    def _read(self) -> dict[str, Entry]:
        try:
            raw = json.loads(self.path.read_text())
            return {
                str(key): (str(choice), float(first), float(second))
                for key, (choice, first, second) in raw.items()
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as error:
            log.warning("ignoring unreadable matmul choices %s: %s", self.path, error)
            return {}
