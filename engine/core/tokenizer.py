"""The model's tokenizer in the engine process, loaded when first needed.

The engine itself runs on token ids; only structured outputs (a grammar's token masks) and the
offline `LLM` read the tokenizer. Loading it means importing transformers, which scans the
source of every model it ships (1-3 s of a 2-core start) before reading the tokenizer files:
a server, which tokenizes in its own process, should not wait for that before /health. So the
engine knows at start whether the model folder has a tokenizer and loads it at the first use
(the first grammar compiles on its own thread, off the step loop).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class LazyTokenizer:
    """`get()`: the folder's transformers tokenizer, loaded once (thread-safe); `available`:
    whether the folder has one (known without loading it)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.available = any((self.model_dir / name).is_file() for name in TOKENIZER_FILES)
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def get(self) -> Any:
        """The tokenizer, or None when the folder has none."""
        if not self.available:
            return None
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            return self._tokenizer
