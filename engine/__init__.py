"""baton's engine: model, memory pools, scheduler, sampler and the offline `LLM` API.

`LLM` and `SamplingParams` are imported on first use (PEP 562): every process that imports any
engine module runs this file, and the server and the router, which use only the engine's
torch-free modules (messages, sampling parameters, the detokenizer), must not pay for torch
(~1.5 s and ~230 MB) through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.llm import LLM
    from engine.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]

_HOMES = {"LLM": "engine.core.llm", "SamplingParams": "engine.core.sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
