"""What the Mamba2 + attention hybrids (NemotronH, Bamba, Granite-4.0-H, Falcon-H1, Zamba2) share:
their layout of layer kinds with the configs of the shared layers, the state every layer use
keeps, and which tensor-parallel sizes their layers can split for. Each family's own fields
(multipliers, shared blocks) live in its family file, in a config type that holds this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from baton.engine import parallel
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.layers.attention import AttentionConfig, attention_state
from baton.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer, mamba_shard
from baton.engine.layers.moe import MoEConfig
from baton.engine.parallel import TensorParallel

# "parallel": attention and Mamba2 side by side on the same normed input (Falcon-H1); "hybrid":
# a use of a shared attention block, then a Mamba2 layer (Zamba2). Both own a KV pool (one per
# use) and a Mamba state.
LayerType = Literal["mamba", "attention", "mlp", "moe", "parallel", "hybrid"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridConfig:
    layer_types: tuple[LayerType, ...]
    norm_eps: float
    attention: AttentionConfig | None  # None: no layer attends
    mamba: Mamba2Config | None  # None: no Mamba layer
    # the dense MLP: "relu2" up/down; "silu" / "gelu" gated gate/up/down
    intermediate_size: int
    mlp_bias: bool
    mlp_hidden_act: str
    moe: MoEConfig | None  # None when no layer is a `moe` block (no MoE key is read)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        """Layers with a Mamba state, in pool order."""
        return tuple(
            i for i, t in enumerate(self.layer_types) if t in ("mamba", "parallel", "hybrid")
        )

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Layers with a KV pool, in pool order."""
        return tuple(
            i for i, t in enumerate(self.layer_types) if t in ("attention", "parallel", "hybrid")
        )


def hybrid_state_spec(config: HybridConfig, dtype: torch.dtype) -> ModelStateSpec:
    """`mamba` layers keep Mamba2 state, `attention` layers K/V; Falcon-H1's `parallel` and
    Zamba2's `hybrid` layers both (attention first: its pool index is the use's)."""
    return ModelStateSpec.of(hybrid_layer_states(config, dtype))


def hybrid_layer_states(config: HybridConfig, dtype: torch.dtype) -> list[LayerState]:
    """The state of every stateful layer use, in forward order (what a family appends its
    own uses to, e.g. an MTP head's attention)."""
    uses: list[LayerState] = []
    for kind in config.layer_types:
        if kind in ("attention", "parallel", "hybrid"):
            attention = config.attention
            uses.append(attention_state(attention.num_kv_heads, attention.head_dim, dtype))
        if kind in ("mamba", "parallel", "hybrid"):
            uses.append(Mamba2Mixer.state_spec(config.mamba, dtype))
    return uses


def check_hybrid_tp(config: HybridConfig, size: int) -> None:
    """ConfigError naming the key when a layer of the model cannot split over `size` ranks:
    every rank's view, built with a group-less TensorParallel (each rule raises its own
    error)."""
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    if config.mamba_layer_ids:
        mamba_shard(config.mamba, probe)
    if config.attention_layer_ids:
        attention = config.attention
        parallel.split_evenly(attention.num_heads, probe, "num_attention_heads")
        parallel.kv_head_part(attention.num_kv_heads, attention.num_heads, probe)
    if "mlp" in config.layer_types:
        parallel.split_evenly(config.intermediate_size, probe, "intermediate_size")
    if config.moe is not None:
        parallel.split_evenly(config.moe.intermediate_size, probe, "moe_intermediate_size")
        parallel.split_evenly(
            config.moe.shared_intermediate_size, probe, "moe_shared_expert_intermediate_size"
        )
