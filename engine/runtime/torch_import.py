"""Keeping torch out of the processes that hold no tensors: the server and the router.

transformers imports torch whenever torch is installed, although its tokenizers and configs,
all the server uses, do not need it; that was ~1.5 s of the server's start on an idle 2-core
machine and ~230 MB of its memory. A module whose sys.modules entry is None is absent to Python
(an import of it raises ImportError, `importlib.util.find_spec` answers None), and transformers
then runs as in an install without torch. `defer_torch` sets that entry before anything imports
transformers; `allow_torch` removes it for what does need torch in such a process: xgrammar,
which the server imports to check a structured-output spec, at the first request that has one
(engine/structured_output/spec.py).
"""

from __future__ import annotations

import logging
import sys


def defer_torch() -> None:
    """Until allow_torch(), this process imports no torch (nor lets transformers use it); a
    no-op once torch is imported (a test process, say). transformers' notice that it found no
    PyTorch is what this asks for, not a broken install: it is dropped (every other message of
    transformers still shows)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        logging.getLogger("transformers").addFilter(_drop_no_torch_notice)


def _drop_no_torch_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("PyTorch was not found.")


def allow_torch() -> None:
    """Undo defer_torch: the next `import torch` loads it."""
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]
