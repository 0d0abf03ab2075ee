"""RecurrentGemma (`RecurrentGemmaForCausalLM`, Google's Griffin): Gemma's residual block around
one of two temporal mixers, cycled by `block_types` (the release: recurrent, recurrent,
attention):

    h = h + temporal_block(temporal_pre_norm(h))   recurrent (RG-LRU, engine/layers/rglru.py) or
                                                   local attention over the last
                                                   `attention_window_size` tokens
    h = h + mlp_block(channel_pre_norm(h))         gelu-tanh gated MLP of intermediate_size // 2,
                                                   with biases

Gemma's parts: the embeddings times sqrt(hidden_size) rounded to bfloat16 (transformers'
`normalizer` buffer is a bfloat16 tensor, cast to the model dtype), zero-centred RMS norms
(scale 1 + w), and the logits soft-capped: cap * tanh(logits / cap) (`logits_soft_cap`).
Attention is MQA/GQA with rotary on the first half of each head (`partial_rotary_factor` 0.5),
q/k/v biases per `attention_bias` and an o_proj bias always. Every attention layer is local, so
the attention's K/V is the "sliding_attention" state kind and the pages behind the window are
released during decode (ModelStateSpec.page_window).

Config read as transformers 5.25's RecurrentGemmaConfig reads it: `lru_width` defaults to
hidden_size, `num_key_value_heads` to num_attention_heads, `head_dim` is the file's (else
hidden / heads), the rope from `rope_parameters` or the legacy top-level `rope_theta` /
`partial_rotary_factor`. Keys transformers would misread are refused by name: the release's
`_block_types` (transformers ignores it and cycles `block_types`, whose default is the
release's pattern) unless both say the same, `embeddings_scale_by_sqrt_dim: false`
(transformers always scales), a `sliding_window` alias that disagrees with
`attention_window_size`, and `logits_soft_cap: null`.

Weights: `model.embed_tokens`, `model.layers.{i}.{temporal_pre_norm, channel_pre_norm}`,
`.temporal_block.` (the recurrent block's or `q_proj, k_proj, v_proj, o_proj`),
`.mlp_block.{gate_proj, up_proj, down_proj}`, `model.final_norm`, `lm_head` (tied by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import LayerState, ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig, RotaryConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, attention_state
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.mlp import ACTIVATIONS, GatedMLP
from baton.engine.layers.norm import ZeroCenteredRMSNorm
from baton.engine.layers.rglru import RecurrentBlock, RGLRUConfig
from baton.engine.parallel import TensorParallel

__all__ = [
    "HF_CONFIG_CLASS_PATH",
    "Model",
    "check_tp",
    "read_config",
    "state_spec",
]

HF_CONFIG_CLASS_PATH = (
    "transformers.models.recurrent_gemma.configuration_recurrent_gemma.RecurrentGemmaConfig"
)

Block = Literal["recurrent", "attention"]
BLOCKS: tuple[str, ...] = ("recurrent", "attention")
# No config key bounds the context (local attention + a recurrence); Griffin trained on 8192.
DEFAULT_MAX_LENGTH = 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class RecurrentGemmaConfig:
    blocks: tuple[Block, ...]  # one per layer: block_types cycled
    norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool  # q/k/v (o_proj always has one)
    window: int  # attention_window_size
    rotary: RotaryConfig
    lru: RGLRUConfig
    intermediate_size: int  # the MLP's width: the config's intermediate_size // 2
    activation: str  # hidden_activation (MLP and the recurrent gate branch)
    logits_soft_cap: float
    embedding_scale: float  # sqrt(hidden_size) rounded to bfloat16


def read_blocks(r: ConfigReader, num_layers: int) -> tuple[Block, ...]:
    pattern = list(r.opt("block_types"))
    legacy = r.hf.get("_block_types")
    if legacy is not None and list(legacy) != pattern:
        raise r.error(
            f"'_block_types'={legacy} differs from 'block_types'={pattern}: transformers "
            "ignores '_block_types' and cycles 'block_types'; write the pattern there"
        )
    if not pattern:
        raise r.error("'block_types' is empty")
    unknown = sorted({b for b in pattern if b not in BLOCKS})
    if unknown:
        raise r.error(
            f"'block_types' has unknown block types {unknown} (RecurrentGemma has {BLOCKS})"
        )
    return tuple(pattern[i % len(pattern)] for i in range(num_layers))


def read_window(r: ConfigReader) -> int:
    window = r.opt("attention_window_size")
    alias = r.hf.get("sliding_window")
    if alias is not None:
        if "attention_window_size" in r.hf and alias != window:
            raise r.error(
                f"'sliding_window'={alias} and 'attention_window_size'={window} disagree "
                "(transformers reads one as the other)"
            )
        window = alias
    if window is None or window < 1:
        raise r.error(f"attention_window_size={window!r}: local attention needs a window >= 1")
    return int(window)


def token_ids(value: int | list[int]) -> tuple[int, ...]:
    """An `eos_token_id` (one id or a list; transformers' default when the file has none)."""
    return tuple(value) if isinstance(value, list) else (value,)


def read_config(r: ConfigReader) -> ModelConfig:
    hidden, num_layers = r.need("hidden_size"), r.need("num_hidden_layers")
    heads = r.opt("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads") or heads
    r.require_multiple("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    width = r.opt("lru_width") or hidden
    r.require_multiple("lru_width", width, "num_attention_heads", heads)
    head_dim = r.hf.get("head_dim") or hidden // heads
    if r.hf.get("embeddings_scale_by_sqrt_dim") is False:
        raise r.error(
            "embeddings_scale_by_sqrt_dim=false: transformers' RecurrentGemma scales the "
            "embeddings by sqrt(hidden_size) whatever this key says"
        )
    cap = r.opt("logits_soft_cap")
    if cap is None:
        raise r.error("logits_soft_cap=null: transformers' RecurrentGemma always soft-caps")
    activation = r.opt("hidden_activation")
    if activation not in ACTIVATIONS:
        raise r.error(
            f"hidden_activation={activation!r} is not supported (baton runs "
            f"{', '.join(map(repr, sorted(ACTIVATIONS)))})"
        )
    return ModelConfig(
        architecture="RecurrentGemmaForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.hf.get("max_position_embeddings") or DEFAULT_MAX_LENGTH,
        num_nextn_predict_layers=0,
        eos_token_ids=token_ids(r.opt("eos_token_id")),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=RecurrentGemmaConfig(
            blocks=read_blocks(r, num_layers),
            norm_eps=float(r.opt("rms_norm_eps")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            attention_bias=bool(r.opt("attention_bias")),
            window=read_window(r),
            rotary=r.rotary(head_dim),
            lru=RGLRUConfig(
                hidden_size=hidden,
                width=width,
                num_heads=heads,
                conv_kernel=r.opt("conv1d_width"),
                activation=activation,
            ),
            intermediate_size=r.opt("intermediate_size") // 2,
            activation=activation,
            logits_soft_cap=float(cap),
            embedding_scale=float(torch.tensor(hidden**0.5, dtype=torch.bfloat16)),
        ),
    )


def layer_state(config: RecurrentGemmaConfig, block: Block, dtype: torch.dtype) -> LayerState:
    if block == "recurrent":
        return RecurrentBlock.state_spec(config.lru, dtype)
    return attention_state(config.num_kv_heads, config.head_dim, dtype, config.window)


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """The conv window and LRU state at recurrent layers; K/V of the last `window` tokens at
    attention layers (every paged kind has a window: pages behind it are released)."""
    family = config.family
    return ModelStateSpec.of([layer_state(family, b, dtype) for b in family.blocks])


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks."""
    family = config.family
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    parallel.split_evenly(family.num_heads, probe, "num_attention_heads")
    if "attention" in family.blocks:
        parallel.kv_head_part(family.num_kv_heads, family.num_heads, probe)
    parallel.split_evenly(family.intermediate_size, probe, "intermediate_size")


class LocalAttention(Attention):
    """Attention over the last `window` tokens whose o_proj has a bias whatever
    `attention_bias` says (transformers' RecurrentGemmaAttention)."""

    def __init__(self, hidden_size: int, family: RecurrentGemmaConfig, index: int):
        super().__init__(
            hidden_size=hidden_size,
            num_heads=family.num_heads,
            num_kv_heads=family.num_kv_heads,
            head_dim=family.head_dim,
            bias=family.attention_bias,
            scale=family.head_dim**-0.5,
            rotary=family.rotary,
            kv_index=index,
            sliding_window=family.window,
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden_size, bias=True)
        if self.tp.size > 1:
            first, _ = parallel.split_evenly(family.num_heads, self.tp, "num_attention_heads")
            columns = ((first * self.head_dim, self.num_heads * self.head_dim),)
            parallel.shard(self.o_proj.weight, parallel.Slices(dim=1, ranges=columns))
            parallel.shard(self.o_proj.bias, parallel.FirstRankOnly(rank=self.tp.rank))


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, family: RecurrentGemmaConfig, block: Block, index: int):
        super().__init__()
        self.temporal_pre_norm = ZeroCenteredRMSNorm(hidden_size, family.norm_eps)
        self.temporal_block = (
            RecurrentBlock(family.lru, index)
            if block == "recurrent"
            else LocalAttention(hidden_size, family, index)
        )
        self.channel_pre_norm = ZeroCenteredRMSNorm(hidden_size, family.norm_eps)
        self.mlp_block = GatedMLP(hidden_size, family.intermediate_size, True, family.activation)

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = hidden + self.temporal_block(self.temporal_pre_norm(hidden), md, cache)
        return hidden + self.mlp_block(self.channel_pre_norm(hidden))


class RecurrentGemmaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        family, hidden = config.family, config.hidden_size
        self.embedding_scale = family.embedding_scale
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            ResidualBlock(hidden, family, block, family.blocks[:i].count(block))
            for i, block in enumerate(family.blocks)
        )
        self.final_norm = ZeroCenteredRMSNorm(hidden, family.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids) * self.embedding_scale
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.final_norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            RecurrentGemmaModel(config),
            "embed_tokens",
            logits_soft_cap=config.family.logits_soft_cap,
        )
