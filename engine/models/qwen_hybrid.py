"""What the Qwen gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE) share: their config
keys, the state every layer use keeps, their TP check and the model itself. Each family file
(qwen3_next.py, qwen3_5.py, qwen3_5_moe.py) says how its checkpoints store the GDN projections
and which layers are MoE.

    h = h + mixer(input_layernorm(h))          gated DeltaNet (`linear_attn`) or gated attention
                                               (`self_attn`: per-head zero-centred q/k norm,
                                               partial rotary, sigmoid output gate)
    h = h + mlp(post_attention_layernorm(h))   SwiGLU MLP, or MoE (softmax top-k experts + a
                                               shared expert scaled by sigmoid(shared_expert_gate))
    logits = lm_head(norm(h))                  every norm zero-centred: (1 + w)

Weights as transformers names them: `model.embed_tokens`, `model.layers.{i}.{input_layernorm,
linear_attn | self_attn, post_attention_layernorm, mlp}`, `model.norm`, `lm_head`; the vision
checkpoints (`...ForConditionalGeneration`) keep the language model under
`model.language_model.` and the vision tower under `model.visual.` (skipped: text only).

Multi-token prediction (speculative decoding with method "mtp"): one MTP layer
(engine/models/qwen_mtp.py), a full-attention decoder layer whose FFN is MoE exactly when layer 0's
is (vLLM builds it as the layer of index 0), built only when the engine drafts with it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import AttentionConfig, attention_state
from baton.engine.layers.blocks import MixerFFNLayer
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.gated_deltanet import GatedDeltaNet, GDNConfig, GDNProjections
from baton.engine.layers.mlp import GatedMLP
from baton.engine.layers.moe import MoE, MoEConfig
from baton.engine.layers.mtp import mtp_state
from baton.engine.layers.norm import ZeroCenteredRMSNorm
from baton.engine.layers.qk_norm_attention import QKNormAttention
from baton.engine.models.qwen_mtp import QwenMTP
from baton.engine.parallel import TensorParallel

log = logging.getLogger(__name__)

LayerType = Literal["linear_attention", "full_attention"]
VISION_PREFIX = "model.visual."
LANGUAGE_PREFIX = "model.language_model."


@dataclass(frozen=True, kw_only=True, slots=True)
class QwenHybridConfig:
    layer_types: tuple[LayerType, ...]
    norm_eps: float
    attention: AttentionConfig
    gdn: GDNConfig
    moe_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense SwiGLU MLP
    intermediate_size: int | None  # of the dense MLP (None: no layer has one)
    moe: MoEConfig | None  # None: no layer is MoE

    def uses(self, kind: LayerType) -> tuple[int, ...]:
        """Layers of `kind`, in pool order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def text_reader(r: ConfigReader) -> ConfigReader:
    """The language model's keys: a vision checkpoint's nested `text_config` (defaults from the
    family's text config class, as transformers fills them), else the file itself."""
    text = r.hf.get("text_config")
    if text is None:
        return r
    return ConfigReader(text, f"{r.source} (text_config)", r.defaults, r.rope_defaults)


def read_layer_types(r: ConfigReader) -> tuple[LayerType, ...]:
    """`layer_types`, else every `full_attention_interval`-th layer attends (transformers'
    default, interval 4)."""
    num_layers = r.opt("num_hidden_layers")
    names = r.opt("layer_types")
    if names is None:
        interval = r.hf.get("full_attention_interval", 4)
        names = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(num_layers)]  # fmt: skip
    unknown = sorted({n for n in names if n not in ("linear_attention", "full_attention")})
    if unknown:
        raise r.error(f"'layer_types' has unknown layer types {unknown}")
    if len(names) != num_layers:
        raise r.error(f"'layer_types' lists {len(names)} layers, num_hidden_layers={num_layers}")
    return tuple(names)


def read_gdn(
    r: ConfigReader, projections: GDNProjections, *, beta_scale: float, norm_eps: float,
    names: tuple[str, str],
) -> GDNConfig:  # fmt: skip
    """The `linear_*` keys every gated DeltaNet family shares."""
    Hk, Hv = r.opt("linear_num_key_heads"), r.opt("linear_num_value_heads")
    r.require_multiple("linear_num_value_heads", Hv, "linear_num_key_heads", Hk)
    # transformers applies hidden_act to the conv output; the conv kernels run SiLU.
    r.require("hidden_act", ("silu",))
    return GDNConfig(
        num_k_heads=Hk,
        num_v_heads=Hv,
        k_head_dim=r.opt("linear_key_head_dim"),
        v_head_dim=r.opt("linear_value_head_dim"),
        conv_kernel=r.opt("linear_conv_kernel_dim"),
        beta_scale=beta_scale,
        norm_eps=norm_eps,
        projections=projections,
        names=names,
    )


def read_config(
    r: ConfigReader,
    *,
    architecture: str,
    projections: GDNProjections,
    moe_layers: tuple[bool, ...],
    moe: MoEConfig | None,
    num_mtp_layers: int,
) -> ModelConfig:
    """The whole config of a Qwen hybrid from its text keys `r` (a vision checkpoint's outer
    file holds tie_word_embeddings); num_mtp_layers: the checkpoint's MTP layers (family key)."""
    t = text_reader(r)
    if num_mtp_layers > 1:
        raise t.error(
            f"{num_mtp_layers} MTP layers are not supported (baton runs one MTP layer, chained"
            " for every draft, as the published checkpoints have)"
        )
    hidden = t.need("hidden_size")
    layer_types = read_layer_types(t)
    num_heads = t.opt("num_attention_heads")
    kv_heads = t.opt("num_key_value_heads")
    t.require_multiple("num_attention_heads", num_heads, "num_key_value_heads", kv_heads)
    head_dim = t.opt("head_dim")
    # Qwen3.5's mrope_section / mrope_interleaved split the rotary frequencies between the
    # temporal, height and width positions of image tokens; text tokens have one position for
    # all three, so text-only input is 1-D partial rotary (transformers computes the same).
    rotary = t.rotary(head_dim)
    # the model runs its GDN state in float32 (transformers ignores the key; baton's kernels
    # hold float32 states)
    if t.has("mamba_ssm_dtype"):
        t.require("mamba_ssm_dtype", (None, "float32"))
    norm_eps = float(t.opt("rms_norm_eps"))
    tie = r.hf.get("tie_word_embeddings", t.opt("tie_word_embeddings"))
    return ModelConfig(
        architecture=architecture,
        vocab_size=t.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(tie),
        max_position_embeddings=t.opt("max_position_embeddings"),
        num_nextn_predict_layers=num_mtp_layers,
        eos_token_ids=t.eos_token_ids() if t.has("eos_token_id") else r.eos_token_ids(),
        bos_token_id=t.opt("bos_token_id"),
        torch_dtype=t.hf.get("dtype") or t.hf.get("torch_dtype") or r.torch_dtype(),
        family=QwenHybridConfig(
            layer_types=layer_types,
            norm_eps=norm_eps,
            attention=AttentionConfig(
                num_heads=num_heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                bias=bool(t.opt("attention_bias")),
                scale=head_dim**-0.5,
                rotary=rotary,
                key_multiplier=1.0,
            ),
            gdn=read_gdn(
                t, projections, beta_scale=1.0, norm_eps=norm_eps, names=("norm", "out_proj")
            ),  # fmt: skip
            moe_layers=moe_layers,
            intermediate_size=None if all(moe_layers) else t.opt("intermediate_size"),
            moe=moe if any(moe_layers) else None,
        ),
    )


def qwen_moe_config(t: ConfigReader, *, norm_topk_prob: bool) -> MoEConfig:
    """Qwen's sparse MoE block: `num_experts` SwiGLU experts, softmax top-k routing, one shared
    SwiGLU expert gated by sigmoid(shared_expert_gate)."""
    num_experts, top_k = int(t.opt("num_experts")), int(t.opt("num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise t.error(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
    return MoEConfig(
        router="softmax_topk",
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(t.opt("moe_intermediate_size")),
        shared_intermediate_size=int(t.opt("shared_expert_intermediate_size")),
        latent_size=None,
        activation="swiglu",
        n_group=1,
        topk_group=1,
        norm_topk_prob=norm_topk_prob,
        norm_topk_eps=0.0,
        expert_bias=False,
        routed_scaling_factor=1.0,
        bias=False,
        shared_expert_gate=True,
    )


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """GDN conv window and recurrent state at `linear_attention` layers, K/V at the others;
    with the MTP layer built, its K/V (pool index after the model's own) and the target's last
    hidden state per request (engine/layers/mtp.py)."""
    qwen = config.family
    kv = attention_state(qwen.attention.num_kv_heads, qwen.attention.head_dim, dtype)
    uses: list[LayerState] = []
    for kind in qwen.layer_types:
        uses.append(GatedDeltaNet.state_spec(qwen.gdn, dtype) if kind == "linear_attention" else kv)
    if config.num_nextn_predict_layers:
        uses += [kv, mtp_state(config.hidden_size, dtype)]
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks: the state (GDN
    key and value heads, KV heads), the attention's query heads, the MLP and MoE widths."""
    qwen = config.family
    state_spec(config, torch.float32).check_tp(size)
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    parallel.split_evenly(qwen.attention.num_heads, probe, "num_attention_heads")
    parallel.kv_head_part(qwen.attention.num_kv_heads, qwen.attention.num_heads, probe)
    if qwen.intermediate_size is not None:
        parallel.split_evenly(qwen.intermediate_size, probe, "intermediate_size")
    if qwen.moe is not None:
        parallel.split_evenly(qwen.moe.intermediate_size, probe, "moe_intermediate_size")
        parallel.split_evenly(
            qwen.moe.shared_intermediate_size, probe, "shared_expert_intermediate_size"
        )


def checkpoint_name(name: str) -> str | None:
    """A vision checkpoint's language model lives under `model.language_model.`; its vision
    tower is skipped (baton serves text only), said once per process."""
    if name.startswith(VISION_PREFIX):
        _log_vision_skipped()
        return None
    if name.startswith(LANGUAGE_PREFIX):
        name = "model." + name[len(LANGUAGE_PREFIX) :]
    # Qwen3.5-MoE releases stack each layer's experts, [gate | up] in one tensor
    return name.replace(".mlp.experts.gate_up_proj", ".mlp.experts.up_proj")


@functools.cache
def _log_vision_skipped() -> None:
    log.info("skipping the vision tower's weights (model.visual.*): baton serves text only")


def decoder_layer(
    hidden: int, qwen: QwenHybridConfig, kind: LayerType, pool_index: int, moe: bool
) -> MixerFFNLayer:
    """pool_index: the layer's index among the layers of its state kind (GDN or K/V)."""
    if kind == "linear_attention":
        name, mixer = "linear_attn", GatedDeltaNet(hidden, qwen.gdn, pool_index)
    else:
        name = "self_attn"
        mixer = QKNormAttention(
            hidden, qwen.attention, pool_index,
            qk_norm="per_head", norm_eps=qwen.norm_eps, output_gate=True,
        )  # fmt: skip
    if moe:
        ffn: nn.Module = MoE(hidden, qwen.moe, shared_name="shared_expert")
    else:
        ffn = GatedMLP(hidden, qwen.intermediate_size, False, "silu")
    return MixerFFNLayer(
        names=("input_layernorm", name, "post_attention_layernorm"),
        hidden_size=hidden,
        eps=qwen.norm_eps,
        mixer=mixer,
        ffn={"mlp": ffn},
        residual_multiplier=1.0,
        norm=ZeroCenteredRMSNorm,
    )


class QwenHybridModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        qwen, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            decoder_layer(hidden, qwen, kind, qwen.uses(kind).index(i), qwen.moe_layers[i])
            for i, kind in enumerate(qwen.layer_types)
        )
        self.norm = ZeroCenteredRMSNorm(hidden, qwen.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        qwen, mtp = config.family, None
        if config.num_nextn_predict_layers:
            kv_index = len(qwen.uses("full_attention"))  # the MTP's K/V follow the model's
            layer = decoder_layer(
                config.hidden_size, qwen, "full_attention", kv_index, qwen.moe_layers[0]
            )
            mtp = QwenMTP(config.hidden_size, qwen.norm_eps, layer)
        super().__init__(config, QwenHybridModel(config), "embed_tokens", mtp=mtp)
