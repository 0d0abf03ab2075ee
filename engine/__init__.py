"""baton's engine: model, memory pools, scheduler, sampler and the offline `LLM` API."""

from engine.llm import LLM
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
