"""Falcon-Mamba (`FalconMambaForCausalLM`, TII): Mamba (engine/models/mamba.py) whose mixer
RMS-normalises dt_low, B and C without weights (eps `mixer_rms_eps`) before dt_proj and the
scan. Same weight names, the same pure-SSM state (no K/V pool)."""

from __future__ import annotations

from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.mamba1 import Mamba1Mixer
from baton.engine.models.mamba import (
    SSMBackbone,
    check_tp,
    checkpoint_name,
    read_mamba1,
    read_ssm,
    state_spec,
)

# What the registry reads here; the state, TP rule and weight names are Mamba's.
__all__ = [
    "HF_CONFIG_CLASS_PATH",
    "Model",
    "check_tp",
    "checkpoint_name",
    "read_config",
    "state_spec",
]

HF_CONFIG_CLASS_PATH = (
    "transformers.models.falcon_mamba.configuration_falcon_mamba.FalconMambaConfig"
)


def read_config(r: ConfigReader) -> ModelConfig:
    return read_ssm(r, "FalconMambaForCausalLM", read_mamba1(r, "weightless", "mixer_rms_eps"))


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, SSMBackbone(config, Mamba1Mixer), "embeddings")
