"""Qwen3.5 MoE (`Qwen3_5MoeForCausalLM`, and the text part of
`Qwen3_5MoeForConditionalGeneration`, e.g. Qwen/Qwen3.5-35B-A3B): Qwen3.5's layers with a sparse
MoE in every layer (softmax top-k always renormalised, a gated shared expert). The model is
engine/models/qwen_hybrid.py's; vision checkpoints as in engine/models/qwen3_5.py.
"""

from __future__ import annotations

from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.models import qwen_hybrid
from baton.engine.models.qwen_hybrid import Model, check_tp, checkpoint_name, state_spec

__all__ = ["Model", "check_tp", "checkpoint_name", "read_config", "state_spec"]

HF_CONFIG_CLASS_PATH = (
    "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeTextConfig"
)


def read_config(r: ConfigReader) -> ModelConfig:
    t = qwen_hybrid.text_reader(r)
    return qwen_hybrid.read_config(
        r,
        architecture=(
            "Qwen3_5MoeForConditionalGeneration" if t is not r else "Qwen3_5MoeForCausalLM"
        ),
        projections="qkv_z_b_a",
        moe_layers=(True,) * t.opt("num_hidden_layers"),
        # transformers' Qwen3.5-MoE router always renormalises (the class has no such key)
        moe=qwen_hybrid.qwen_moe_config(t, norm_topk_prob=True),
        num_mtp_layers=int(t.hf.get("mtp_num_hidden_layers") or 0),  # as Qwen3.5's
    )
