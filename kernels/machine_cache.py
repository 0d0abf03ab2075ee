"""Where what is made once per machine is kept (C builds, matmul timings, config defaults):
`$BATON_CACHE_DIR`, else ~/.cache/baton. Torch-free, so the server and the config reader can
name it without importing torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
