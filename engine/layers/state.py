"""The state spec of the Mamba2 + attention hybrids (every family of round 2): one entry per
stateful layer use, in forward order, from the config's layer types."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.layers.attention import attention_state
from engine.layers.mamba2 import Mamba2Mixer
from engine.state_spec import LayerState, ModelStateSpec


def hybrid_state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """`mamba` layers keep Mamba2 state, `attention` layers K/V; Falcon-H1's `parallel` and
    Zamba2's `hybrid` layers both (attention first: its pool index is the use's)."""
    attention = attention_state(config.num_key_value_heads, config.head_dim, dtype)
    mamba = Mamba2Mixer.state_spec(config, dtype)
    uses: list[LayerState] = []
    for kind in config.layer_types:
        if kind in ("attention", "parallel", "hybrid"):
            uses.append(attention)
        if kind in ("mamba", "parallel", "hybrid"):
            uses.append(mamba)
    return ModelStateSpec.of(uses)
