"""Qwen3.5 dense (`Qwen3_5ForCausalLM`, and the text part of `Qwen3_5ForConditionalGeneration`,
e.g. Qwen/Qwen3.5-27B): gated DeltaNet and gated attention 3:1, a SwiGLU MLP in every layer
(engine/models/qwen_hybrid.py holds the model). Its GDN projections are stored apart
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).

The published checkpoints are the vision-language ones: the language model's keys nest under
`text_config`, its weights under `model.language_model.`; the vision tower is skipped and image
inputs are refused by the server (text content parts only). Its MTP layer
(engine/models/qwen_mtp.py): `mtp_num_hidden_layers` of the text config (a key transformers'
config class does not have), its weights `mtp.*` at the checkpoint's top level.
"""

from __future__ import annotations

from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.models import qwen_hybrid
from baton.engine.models.qwen_hybrid import Model, check_tp, checkpoint_name, state_spec

__all__ = ["Model", "check_tp", "checkpoint_name", "read_config", "state_spec"]

HF_CONFIG_CLASS_PATH = "transformers.models.qwen3_5.configuration_qwen3_5.Qwen3_5TextConfig"


def read_config(r: ConfigReader) -> ModelConfig:
    t = qwen_hybrid.text_reader(r)
    return qwen_hybrid.read_config(
        r,
        architecture="Qwen3_5ForConditionalGeneration" if t is not r else "Qwen3_5ForCausalLM",
        projections="qkv_z_b_a",
        moe_layers=(False,) * t.opt("num_hidden_layers"),
        moe=None,
        num_mtp_layers=int(t.hf.get("mtp_num_hidden_layers") or 0),
    )
