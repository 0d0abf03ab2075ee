"""LFM2-MoE (`Lfm2MoeForCausalLM`, Liquid AI): LFM2's layers (engine/models/lfm2.py) whose
feed-forward is a mixture of experts from layer `num_dense_layers` on (the first ones keep a
dense SwiGLU MLP of `intermediate_size`, not auto-adjusted): a sigmoid router whose top-k choice
is steered by `expert_bias` (when `use_expert_bias`), weights divided by their sum + 1e-6 when
`norm_topk_prob`, times `routed_scaling_factor`; SwiGLU experts of `moe_intermediate_size`, no
shared expert. `layer_types` is required (transformers fills no default for it).

Weights as LFM2's, plus `.feed_forward.gate.weight`, `.feed_forward.expert_bias` and
`.feed_forward.experts.{e}.{w1,w3,w2}.weight`.
"""

from __future__ import annotations

from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.layers.moe import MoEConfig
from baton.engine.models.lfm2 import Model, check_tp, checkpoint_name, read_common, state_spec

# What the registry reads here; the layers, state, TP rule and weight names are LFM2's.
__all__ = [
    "HF_CONFIG_CLASS_PATH",
    "Model",
    "check_tp",
    "checkpoint_name",
    "read_config",
    "state_spec",
]

HF_CONFIG_CLASS_PATH = "transformers.models.lfm2_moe.configuration_lfm2_moe.Lfm2MoeConfig"


def read_config(r: ConfigReader) -> ModelConfig:
    num_layers, num_experts = r.need("num_hidden_layers"), int(r.opt("num_experts"))
    top_k, dense = int(r.opt("num_experts_per_tok")), int(r.opt("num_dense_layers"))
    if not 1 <= top_k <= num_experts:
        raise r.error(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
    if not 0 <= dense <= num_layers:
        raise r.error(f"num_dense_layers={dense} must be in 0..num_hidden_layers={num_layers}")
    moe = MoEConfig(
        router="sigmoid_grouped",
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(r.opt("moe_intermediate_size")),
        shared_intermediate_size=None,
        latent_size=None,
        activation="swiglu",
        n_group=1,
        topk_group=1,
        norm_topk_prob=bool(r.opt("norm_topk_prob")),
        norm_topk_eps=1e-6,  # transformers' Lfm2MoeTopKRouter
        expert_bias=bool(r.opt("use_expert_bias")),
        routed_scaling_factor=float(r.opt("routed_scaling_factor")),
        bias=False,
        shared_expert_gate=False,
    )
    return read_common(
        r,
        "Lfm2MoeForCausalLM",
        legacy=False,
        intermediate_size=r.need("intermediate_size"),
        moe=moe if dense < num_layers else None,
        num_dense_layers=dense,
    )
