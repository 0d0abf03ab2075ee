"""baton: an inference server for hybrid state-space / linear-attention + attention models.

The code lives in the repository's top-level folders (server/, engine/, kernels/, disagg/,
bench/); this package is the one import name they are installed under: `baton.server`,
`baton.engine`, ... are links to those folders (DESIGN.md section 2). None of the folders is a
package of its own, so no process started in the repository root can import them as `kernels`,
`server`, `engine`, `disagg` or `bench` in place of another distribution's (Hugging Face's
`kernels`, a transformers dependency, is one).

`LLM`, `SamplingParams` and `LoRARequest` (the offline API, vLLM's shape: `from baton import LLM,
SamplingParams, LoRARequest`) are imported on first use (PEP 562): the server and the router import this file
too, and use only torch-free modules; they must not pay for torch (~1.5 s, ~230 MB) through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from baton.engine.core.llm import LLM
    from baton.engine.core.sampling_params import SamplingParams
    from baton.engine.lora.request import LoRARequest

__all__ = ["LLM", "LoRARequest", "SamplingParams"]

_HOMES = {
    "LLM": "baton.engine.core.llm",
    "SamplingParams": "baton.engine.core.sampling_params",
    "LoRARequest": "baton.engine.lora.request",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'baton' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
