"""baton's engine: model, memory pools, scheduler, sampler and the offline `LLM` API."""

from engine.core.llm import LLM
from engine.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
