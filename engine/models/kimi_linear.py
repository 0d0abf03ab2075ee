"""Kimi Linear (`KimiLinearForCausalLM`, e.g. moonshotai/Kimi-Linear-48B-A3B-Instruct): Kimi Delta
Attention (engine/layers/kda.py) in most layers, NoPE multi-head latent attention
(engine/layers/mla.py) in the others, a DeepSeek-style MoE (sigmoid router with a score-correction
bias, grouped top-k, renormalised and scaled weights, one shared SwiGLU expert of
moe_intermediate_size * num_shared_experts) after the first `first_k_dense_replace` layers, a
dense SwiGLU MLP before them.

    h = h + self_attn(input_layernorm(h))          KDA or MLA
    h = h + mlp(post_attention_layernorm(h))       SwiGLU MLP or MoE
    logits = lm_head(norm(h))

Config keys as transformers 5.25's KimiLinearConfig reads them: `linear_attn_config`
({num_heads, head_dim, short_conv_kernel_size, kda_layers, full_attn_layers}, the layer lists
1-indexed) wins over the flat `linear_*` keys; `layer_types` when given, else the two lists, else
every 4th layer from index 4 attends; `mlp_layer_types` when given, else `first_k_dense_replace`
(1 when absent); the released spellings `num_experts`, `num_experts_per_token`,
`num_shared_experts`, `moe_renormalize`, `num_expert_group`, `model_max_length` and the
transformers attribute names (`num_local_experts`, `num_experts_per_tok`, `n_shared_experts`,
`norm_topk_prob`, `n_group`, `max_position_embeddings`) alike. Keys transformers does not read
but whose other values it would silently misrun are refused by name when they say something else
than it runs: `mla_use_nope` (it always runs NoPE), `moe_router_activation_func` (sigmoid),
`moe_layer_freq` (1).

Weights as the release names them (transformers' save_pretrained writes the same):
`model.layers.{i}.self_attn.*` (KDA's or MLA's), the dense MLP under `.mlp.` (save_pretrained
writes it under `.block_sparse_moe.`) and the MoE under `.block_sparse_moe.` with per-expert
`experts.{e}.{w1, w3, w2}` (gate, up, down), read into the shared MoE layer's names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.kda import KDAConfig, KimiDeltaAttention
from baton.engine.layers.mla import MLAConfig, MultiHeadLatentAttention, mla_state
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.moe import MoE, MoEConfig
from baton.engine.layers.mtp import mtp_state
from baton.engine.layers.norm import RMSNorm
from baton.engine.models.bailing_mtp import BailingMTP
from baton.engine.parallel import TensorParallel

HF_CONFIG_CLASS_PATH = "transformers.models.kimi_linear.configuration_kimi_linear.KimiLinearConfig"

LayerType = Literal["linear_attention", "full_attention"]

# on-disk names -> the shared layers' (the MoE's per-expert w1/w3/w2, the dense MLP that
# save_pretrained writes under block_sparse_moe, transformers' in-memory forget_gate prefix)
RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class KimiLinearConfig:
    layer_types: tuple[LayerType, ...]
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense SwiGLU MLP
    norm_eps: float
    kda: KDAConfig
    mla: MLAConfig
    intermediate_size: int | None  # of the dense MLP (None: every layer is MoE)
    moe: MoEConfig | None  # None: no layer is MoE

    def uses(self, kind: LayerType) -> tuple[int, ...]:
        """Layers of `kind`, in pool order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def aliased(r: ConfigReader, stored: str, attribute: str):
    """A key transformers' attribute_map lets the file spell two ways: the released spelling
    (`stored`), else the attribute's, else the class default (filed under the attribute)."""
    return r.hf[stored] if stored in r.hf else r.opt(attribute)


def read_layer_types(r: ConfigReader, num_layers: int) -> tuple[LayerType, ...]:
    names = r.hf.get("layer_types")
    linear = r.hf.get("linear_attn_config") or {}
    if names is None and "full_attn_layers" in linear and "kda_layers" in linear:
        slots: list[LayerType | None] = [None] * num_layers
        for key, kind in (
            ("full_attn_layers", "full_attention"),
            ("kda_layers", "linear_attention"),
        ):
            for layer in linear[key]:  # 1-indexed; a layer in both lists is KDA, as there
                if not 1 <= layer <= num_layers:
                    raise r.error(
                        f"linear_attn_config.{key} lists layer {layer} (1-indexed) of "
                        f"num_hidden_layers={num_layers}"
                    )
                slots[layer - 1] = kind
        missing = [i + 1 for i, kind in enumerate(slots) if kind is None]
        if missing:
            raise r.error(
                f"linear_attn_config: layers {missing} (1-indexed) are in neither kda_layers "
                "nor full_attn_layers"
            )
        names = slots
    elif names is None:  # transformers' default
        names = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                 for i in range(num_layers)]  # fmt: skip
    unknown = sorted({str(n) for n in names if n not in ("linear_attention", "full_attention")})
    if unknown:
        raise r.error(f"'layer_types' has unknown layer types {unknown}")
    if len(names) != num_layers:
        raise r.error(f"'layer_types' lists {len(names)} layers, num_hidden_layers={num_layers}")
    return tuple(names)


def read_sparse_layers(r: ConfigReader, num_layers: int) -> tuple[bool, ...]:
    names = r.hf.get("mlp_layer_types")
    if names is None:
        # not a KimiLinearConfig field: transformers reads it from the keyword arguments, 1
        # when absent
        first_dense = int(r.hf.get("first_k_dense_replace", 1))
        names = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    unknown = sorted({str(n) for n in names if n not in ("dense", "sparse")})
    if unknown or len(names) != num_layers:
        raise r.error(
            f"'mlp_layer_types' must list 'dense' or 'sparse' for each of {num_layers} layers, "
            f"got {names}"
        )
    return tuple(n == "sparse" for n in names)


def refuse_other_than(r: ConfigReader, key: str, runs) -> None:
    """A key transformers ignores, refused when it asks for something else than it runs."""
    if key in r.hf and r.hf[key] != runs:
        raise r.error(f"{key}={r.hf[key]!r} is not supported (transformers and baton run {runs!r})")


def read_moe(r: ConfigReader) -> MoEConfig:
    num_experts = int(aliased(r, "num_experts", "num_local_experts"))
    top_k = int(aliased(r, "num_experts_per_token", "num_experts_per_tok"))
    n_group = int(aliased(r, "num_expert_group", "n_group"))
    topk_group = int(r.opt("topk_group"))
    shared = int(aliased(r, "num_shared_experts", "n_shared_experts"))
    if not 1 <= top_k <= num_experts:
        raise r.error(f"num_experts_per_token={top_k} must be in 1..num_experts={num_experts}")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise r.error(
            f"num_expert_group={n_group} must divide num_experts={num_experts}, and topk_group="
            f"{topk_group} be in 1..num_expert_group"
        )
    if num_experts // n_group < 2:  # transformers scores a group by its two best experts
        raise r.error(f"num_expert_group={n_group} leaves fewer than 2 experts in a group")
    moe_inter = int(r.opt("moe_intermediate_size"))
    return MoEConfig(
        router="sigmoid_grouped",
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * shared if shared else None,
        latent_size=None,
        activation="swiglu",
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(aliased(r, "moe_renormalize", "norm_topk_prob")),
        norm_topk_eps=1e-20,  # transformers' KimiLinearTopkRouter
        expert_bias=True,
        routed_scaling_factor=float(r.opt("routed_scaling_factor")),
        bias=False,
        shared_expert_gate=False,
    )


def read_config(r: ConfigReader) -> ModelConfig:
    num_layers = int(r.opt("num_hidden_layers"))
    # the conv activation and every MLP's; the conv kernels run SiLU
    r.require("hidden_act", ("silu",))
    refuse_other_than(r, "mla_use_nope", True)
    refuse_other_than(r, "moe_router_activation_func", "sigmoid")
    refuse_other_than(r, "moe_layer_freq", 1)
    heads, kv_heads = int(r.opt("num_attention_heads")), r.opt("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        # transformers' MLA expands the latent to every head, then repeats by heads / kv_heads
        raise r.error(
            f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (MLA)"
        )
    linear = r.hf.get("linear_attn_config") or {}
    norm_eps = float(r.opt("rms_norm_eps"))
    sparse = read_sparse_layers(r, num_layers)
    eos = r.opt("eos_token_id")
    q_lora = r.opt("q_lora_rank")
    return ModelConfig(
        architecture="KimiLinearForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=r.need("hidden_size"),
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=int(aliased(r, "model_max_length", "max_position_embeddings")),
        num_nextn_predict_layers=0,  # transformers builds no MTP layer for Kimi Linear
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=KimiLinearConfig(
            layer_types=read_layer_types(r, num_layers),
            sparse_layers=sparse,
            norm_eps=norm_eps,
            kda=KDAConfig(
                num_heads=int(linear.get("num_heads", r.opt("linear_num_heads"))),
                head_dim=int(linear.get("head_dim", r.opt("linear_head_dim"))),
                conv_kernel=int(
                    linear.get("short_conv_kernel_size", r.opt("linear_conv_kernel_dim"))
                ),
                norm_eps=norm_eps,
                projections="low_rank",
                gate_lower_bound=None,
            ),
            mla=MLAConfig(
                num_heads=heads,
                q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(r.opt("kv_lora_rank")),
                qk_nope_head_dim=int(r.opt("qk_nope_head_dim")),
                qk_rope_head_dim=int(r.opt("qk_rope_head_dim")),
                v_head_dim=int(r.opt("v_head_dim")),
                bias=bool(r.opt("attention_bias")),
                rotary=None,  # NoPE: transformers' KimiLinearAttention rotates nothing
                head_gate=False,
            ),
            intermediate_size=None if all(sparse) else int(r.opt("intermediate_size")),
            moe=read_moe(r) if any(sparse) else None,
        ),
    )


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """KDA conv windows and recurrent state at `linear_attention` layers, one MLA latent row per
    token at the others; with Bailing's MTP layer built, its latent pages (pool index after the
    model's own) and the target's last hidden state per request (engine/layers/mtp.py)."""
    kimi = config.family
    uses: list[LayerState] = [
        KimiDeltaAttention.state_spec(kimi.kda, dtype)
        if kind == "linear_attention"
        else mla_state(kimi.mla, dtype)
        for kind in kimi.layer_types
    ]
    if config.num_nextn_predict_layers:
        uses += [mla_state(kimi.mla, dtype), mtp_state(config.hidden_size, dtype)]
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks: KDA heads (the
    state spec), MLA query heads (the latent is replicated), the MLP and MoE widths."""
    kimi = config.family
    state_spec(config, torch.float32).check_tp(size)
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    if kimi.uses("full_attention"):
        parallel.split_evenly(kimi.mla.num_heads, probe, "num_attention_heads")
    if kimi.intermediate_size is not None:
        parallel.split_evenly(kimi.intermediate_size, probe, "intermediate_size")
    if kimi.moe is not None:
        parallel.split_evenly(kimi.moe.intermediate_size, probe, "moe_intermediate_size")
        if kimi.moe.shared_intermediate_size is not None:
            parallel.split_evenly(
                kimi.moe.shared_intermediate_size,
                probe,
                "moe_intermediate_size x num_shared_experts",
            )


def checkpoint_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name


def decoder_layer(
    hidden: int, kimi: KimiLinearConfig, kind: LayerType, index: int, sparse: bool
) -> MixerFFNLayer:
    """index: the layer's pool index among the layers of its kind; sparse: MoE, else the dense
    MLP."""
    if kind == "linear_attention":
        mixer: nn.Module = KimiDeltaAttention(hidden, kimi.kda, index)
    else:
        mixer = MultiHeadLatentAttention(hidden, kimi.mla, index)
    if sparse:
        ffn: nn.Module = MoE(hidden, kimi.moe, shared_name="shared_experts")
    else:
        ffn = GatedMLP(hidden, kimi.intermediate_size, False, "silu")
    return MixerFFNLayer(
        names=("input_layernorm", "self_attn", "post_attention_layernorm"),
        hidden_size=hidden,
        eps=kimi.norm_eps,
        mixer=mixer,
        ffn={"mlp": ffn},
        residual_multiplier=1.0,
    )


class KimiLinearModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        kimi, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            decoder_layer(hidden, kimi, kind, kimi.uses(kind).index(i), kimi.sparse_layers[i])
            for i, kind in enumerate(kimi.layer_types)
        )
        self.norm = RMSNorm(hidden, kimi.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        kimi, mtp = config.family, None
        if config.num_nextn_predict_layers:  # Bailing's MTP layer: MLA, then MoE if any
            index = len(kimi.uses("full_attention"))  # its latent pages follow the model's
            layer = decoder_layer(
                config.hidden_size, kimi, "full_attention", index, kimi.moe is not None
            )
            mtp = BailingMTP(config.hidden_size, kimi.norm_eps, layer)
        super().__init__(config, KimiLinearModel(config), "embed_tokens", mtp=mtp)
