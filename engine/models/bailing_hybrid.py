"""Bailing hybrid (`BailingHybridForCausalLM`, inclusionAI's Ling / Ring hybrid linear models): the
layers of Kimi Linear (engine/models/kimi_linear.py holds the model) with

    KDA    full-rank decay and output-gate projections (`f_proj`, `g_proj`), A_log of shape (H,),
           the decay bounded when `kda_safe_gate`: g = kda_lower_bound sigmoid(exp(A_log) (f +
           dt_bias)); KDA heads and head dim are the attention's (`num_attention_heads`,
           `head_dim`), its conv `short_conv_kernel_size`
    MLA    DeepSeek's interleaved rotary on the rope part (`rope_parameters`, default type) and a
           per-head output gate sigmoid(g_proj(x))
    layout the last layer of every `layer_group_size` attends (MLA), the others are KDA, unless
           `layer_types` says; dense SwiGLU MLPs in the first `first_k_dense_replace` layers
           (default 2), MoE after them (the DeepSeek router of Kimi Linear)

Config keys as transformers 5.25's BailingHybridConfig reads them, the released spellings
(`num_experts`, `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`,
`num_expert_group`, `model_max_length`, `num_nextn_predict_layers`) and the attribute names alike;
a file transformers itself wrote carries `linear_num_heads` / `linear_head_dim` /
`linear_conv_kernel_dim`, which transformers lets win over the keys above, and so does baton.
Refused by name: non-zero SwiGLU clipping limits (`expert_swiglu_limit_list`,
`share_expert_swiglu_limit_list`; the shared MoE kernels do not clip).

Weights as Ling's releases name them (transformers' save_pretrained writes the same):
`model.word_embeddings`, `model.layers.{i}.attention.*` with `dense` for the output projection,
the router's `gate.expert_bias`, per-expert `experts.{e}.{gate,up,down}_proj`; read into the
shared layers' names. The MTP layer the releases store after the decoder
(`model.layers.{num_hidden_layers}`, `num_nextn_predict_layers` of them, at most 1) drafts for
speculative decoding with method "mtp" (engine/models/bailing_mtp.py); transformers ignores it.
"""

from __future__ import annotations

import re

from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.layers.kda import KDAConfig
from baton.engine.layers.mla import MLAConfig
from baton.engine.models.bailing_mtp import mtp_renamer
from baton.engine.models.kimi_linear import (
    KimiLinearConfig,
    Model,
    aliased,
    check_tp,
    read_moe,
    state_spec,
)

__all__ = ["HF_CONFIG_CLASS_PATH", "Model", "check_tp", "checkpoint_name", "checkpoint_renamer",
           "read_config", "state_spec"]  # fmt: skip

HF_CONFIG_CLASS_PATH = (
    "transformers.models.bailing_hybrid.configuration_bailing_hybrid.BailingHybridConfig"
)

# on-disk names -> the shared layers' (transformers' conversion mapping for bailing_hybrid)
RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)


def checkpoint_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name


def read_mtp_layers(r: ConfigReader) -> int:
    """The MTP layers the checkpoint stores after its decoder (transformers' default: 1)."""
    count = int(aliased(r, "num_nextn_predict_layers", "num_mtp_layers") or 0)
    if count > 1:
        raise r.error(
            f"num_nextn_predict_layers={count}: {count} MTP layers are not supported (baton "
            "runs one MTP layer, chained for every draft, as SGLang does)"
        )
    return count


def checkpoint_renamer(config: ModelConfig):
    """checkpoint_name, with the MTP layer stored after the decoder read as `mtp.*`."""
    return mtp_renamer(len(config.family.layer_types), checkpoint_name)


# Keys of Ling's releases that transformers' BailingHybridConfig does not read: its model runs
# these values only (head-wise MLA output gate, full-rank KDA gates, interleaved rotary, the
# router's expert bias), so a file saying otherwise would be silently misrun: refused by name.
FIXED = {
    "gated_attention_proj_granularity_type": "head_wise",
    "no_kda_lora": True,
    "rope_interleave": True,
    "moe_router_enable_expert_bias": True,
}


def read_config(r: ConfigReader) -> ModelConfig:
    num_layers = int(r.opt("num_hidden_layers"))
    r.require("hidden_act", ("silu",))  # the conv activation and every MLP's
    for key, runs in FIXED.items():
        if key in r.hf and r.hf[key] != runs:
            raise r.error(f"{key}={r.hf[key]!r} is not supported (the Bailing hybrid of "
                          f"transformers, and baton, run {runs!r})")  # fmt: skip
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        limits = r.hf.get(key) or []
        if any(limits):
            raise r.error(f"{key}={limits}: SwiGLU clipping is not supported (only zeros)")
    names = r.hf.get("layer_types")
    if names is None:  # transformers' default
        group = int(r.opt("layer_group_size"))
        names = ["full_attention" if (i + 1) % group == 0 else "linear_attention"
                 for i in range(num_layers)]  # fmt: skip
    if len(names) != num_layers or set(names) - {"linear_attention", "full_attention"}:
        raise r.error(f"'layer_types' must name {num_layers} layers linear_attention or "
                      f"full_attention, got {names}")  # fmt: skip
    mlp_types = r.hf.get("mlp_layer_types")
    if mlp_types is None:
        first_dense = int(r.opt("first_k_dense_replace"))
        mlp_types = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    if len(mlp_types) != num_layers or set(mlp_types) - {"dense", "sparse"}:
        raise r.error(f"'mlp_layer_types' must name {num_layers} layers dense or sparse, "
                      f"got {mlp_types}")  # fmt: skip
    sparse = tuple(t == "sparse" for t in mlp_types)
    heads, kv_heads = int(r.opt("num_attention_heads")), r.opt("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise r.error(
            f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (MLA)"
        )
    rope = int(r.opt("qk_rope_head_dim"))
    norm_eps = float(r.opt("rms_norm_eps"))
    eos = r.opt("eos_token_id")
    q_lora = r.opt("q_lora_rank")
    moe = read_moe(r) if any(sparse) else None
    shared = r.hf.get("moe_shared_expert_intermediate_size")  # Ling's; transformers derives it
    if moe is not None and shared is not None and int(shared) != moe.shared_intermediate_size:
        raise r.error(
            f"moe_shared_expert_intermediate_size={shared}: transformers runs the shared expert "
            f"at moe_intermediate_size x num_shared_experts = {moe.shared_intermediate_size}"
        )
    return ModelConfig(
        architecture="BailingHybridForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=r.need("hidden_size"),
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=int(aliased(r, "model_max_length", "max_position_embeddings")),
        num_nextn_predict_layers=read_mtp_layers(r),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=KimiLinearConfig(
            layer_types=tuple(names),
            sparse_layers=sparse,
            norm_eps=norm_eps,
            kda=KDAConfig(
                num_heads=int(r.hf.get("linear_num_heads", heads)),
                head_dim=int(r.hf.get("linear_head_dim", r.opt("head_dim"))),
                conv_kernel=int(
                    r.hf.get("linear_conv_kernel_dim", r.opt("short_conv_kernel_size"))
                ),
                norm_eps=norm_eps,
                projections="full_rank",
                gate_lower_bound=(
                    float(r.opt("kda_lower_bound")) if r.opt("kda_safe_gate") else None
                ),
            ),
            mla=MLAConfig(
                num_heads=heads,
                q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(r.opt("kv_lora_rank")),
                qk_nope_head_dim=int(r.opt("qk_nope_head_dim")),
                qk_rope_head_dim=rope,
                v_head_dim=int(r.opt("v_head_dim")),
                bias=bool(r.opt("attention_bias")),
                rotary=r.rotary(rope, partial=False),
                head_gate=True,
            ),
            intermediate_size=None if all(sparse) else int(r.opt("intermediate_size")),
            moe=moe,
        ),
    )
