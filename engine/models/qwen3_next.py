"""Qwen3-Next (`Qwen3NextForCausalLM`, e.g. Qwen/Qwen3-Next-80B-A3B-Instruct): gated DeltaNet
and gated attention 3:1, a sparse MoE (softmax top-k, `norm_topk_prob`, a gated shared expert)
in every `decoder_sparse_step`-th layer not in `mlp_only_layers`, a SwiGLU MLP elsewhere
(engine/models/qwen_hybrid.py holds the model).

Its GDN input projections are packed per key head (`in_proj_qkvz`, `in_proj_ba`); the layer reads
them back in blocked order (engine/layers/gated_deltanet.py). Its experts are stored per expert
(`mlp.experts.{e}.gate_proj / up_proj / down_proj`).

Its MTP layer (engine/models/qwen_mtp.py): `num_nextn_predict_layers`, 1 when absent as vLLM
reads it (the published configs do not name it; their checkpoints hold `mtp.*`).
"""

from __future__ import annotations

from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.models import qwen_hybrid
from baton.engine.models.qwen_hybrid import Model, check_tp, checkpoint_name, state_spec

__all__ = ["Model", "check_tp", "checkpoint_name", "read_config", "state_spec"]

HF_CONFIG_CLASS_PATH = "transformers.models.qwen3_next.configuration_qwen3_next.Qwen3NextConfig"


def read_config(r: ConfigReader) -> ModelConfig:
    num_layers = r.opt("num_hidden_layers")
    mlp_only = set(r.opt("mlp_only_layers") or [])
    num_experts, step = int(r.opt("num_experts")), int(r.opt("decoder_sparse_step"))
    if step < 1:
        raise r.error(f"decoder_sparse_step={step} must be at least 1")
    # transformers' rule (Qwen3NextDecoderLayer)
    moe_layers = tuple(
        i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )
    moe = (
        qwen_hybrid.qwen_moe_config(r, norm_topk_prob=bool(r.opt("norm_topk_prob")))
        if any(moe_layers)
        else None
    )
    num_mtp = r.hf.get("num_nextn_predict_layers")  # absent: 1, as vLLM reads it
    return qwen_hybrid.read_config(
        r,
        architecture="Qwen3NextForCausalLM",
        projections="qkvz_ba",
        moe_layers=moe_layers,
        moe=moe,
        num_mtp_layers=1 if num_mtp is None else int(num_mtp),
    )
