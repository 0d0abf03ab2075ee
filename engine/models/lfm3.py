"""LFM3 (`Lfm3ForCausalLM`, Liquid AI): LFM2's gated short convolutions (engine/layers/short_conv.py)
beside two attention kinds, each layer with sandwich norms:

    h = h + post_operator_norm(mixer(operator_norm(h)))   mixer: short conv, sliding-window or
    h = h + post_ffn_norm(mlp(ffn_norm(h)))               full attention; mlp: SwiGLU w1/w3/w2

Attention is Qwen3's (per-head q/k RMS norms before the rotary) with a sigmoid output gate per
head, `g_proj(x)`, on the attention's output before o_proj (`use_attention_gate`). Sliding layers
attend to the last `sliding_window` tokens (their K/V pools are a state kind of their own,
"sliding_attention", engine/layers/attention.py); full layers to all. Each kind has its own
rotary: `rope_parameters` is keyed by layer type ("sliding_attention", "full_attention"); the
release's sliding layers use the default rope (theta 1e4, whole heads), its full layers
"proportional" rope (theta 1e6, partial_rotary_factor 0.5): rotate_half over whole heads with
frequencies theta ** -(2i / head_dim) for the first int(factor * head_dim / 2) pairs and 0 (no
rotation) for the rest, which is not the usual partial rotary of the first channels.

Config read as transformers 5.25's Lfm3Config reads it: `head_dim` defaults to 128 (not
hidden / heads), `intermediate_size` is the MLP's width as written (LFM2's block_* adjustments
do not exist here), `norm_eps` (alias `rms_norm_eps`), `layer_types` defaults to transformers'
pattern (full at i % 4 == 2, sliding at i % 4 == 0 past layer 0, conv elsewhere), and
`rope_parameters` to the release's per-type dict. A flat `rope_parameters` (one dict for every
layer) is refused by name: transformers looks it up by layer type and fails; so is a rope_type
other than default / proportional, and `sliding_window: null` with sliding layers.

Pages: the sliding layers' pages behind the window are released during decode
(ModelStateSpec.page_window). Beside full-attention layers, which read every page until a
request ends, they keep a page table of their own, whose pool shares the full layers' memory
(ModelStateSpec.page_tables).

Weights: `model.embed_tokens`, `model.layers.{i}.{operator_norm,ffn_norm,post_operator_norm,
post_ffn_norm}`, `.conv.{in_proj,conv,out_proj}` or `.self_attn.{q,k,v,o}_proj`,
`.self_attn.{q_norm,k_norm,gate_proj}`, `.feed_forward.{w1,w3,w2}`, `model.embedding_norm`,
`lm_head` (tied by default). The attention gate is `gate_proj` on disk (transformers' conversion
mapping renames it to `g_proj` in memory, and save_pretrained writes `gate_proj` back); both
load as `g_proj`.
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
from baton.engine.config import ConfigReader, ModelConfig, RotaryConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, attention_state
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.mlp import GatedMLP, fuse_for_cpu
from baton.engine.layers.norm import RMSNorm
from baton.engine.layers.short_conv import ShortConv, ShortConvConfig
from baton.engine.models import lfm2
from baton.engine.parallel import TensorParallel

__all__ = [
    "HF_CONFIG_CLASS_PATH",
    "Model",
    "check_tp",
    "checkpoint_name",
    "read_config",
    "state_spec",
]

HF_CONFIG_CLASS_PATH = "transformers.models.lfm3.configuration_lfm3.Lfm3Config"

Mixer = Literal["conv", "sliding_attention", "full_attention"]
MIXERS: tuple[str, ...] = ("conv", "sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")


@dataclass(frozen=True, kw_only=True, slots=True)
class Lfm3Rope:
    """One attention kind's rotary: inv_freq as transformers computes it for that layer type."""

    rope_type: str  # "default" or "proportional"
    theta: float
    partial_rotary_factor: float  # proportional only (default rope rotates whole heads)
    factor: float  # proportional only: the frequencies are divided by it


@dataclass(frozen=True, kw_only=True, slots=True)
class Lfm3Config:
    mixers: tuple[Mixer, ...]  # one per layer
    norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    attention_gate: bool  # use_attention_gate
    sandwich_norm: bool  # use_sandwich_norm
    sliding_window: int | None  # None only when no layer is sliding
    rope: dict[str, Lfm3Rope]  # attention layer type -> its rotary
    conv: ShortConvConfig
    intermediate_size: int


GATE_ON_DISK = re.compile(r"\.self_attn\.gate_proj\.")


def checkpoint_name(name: str) -> str:
    """LFM2's renames (the MLP's w1/w3/w2) and the attention gate's on-disk name."""
    return lfm2.checkpoint_name(GATE_ON_DISK.sub(".self_attn.g_proj.", name))


def read_rope(r: ConfigReader, layer_type: str) -> Lfm3Rope:
    params = r.hf.get("rope_parameters") or r.rope_defaults
    if "rope_type" in params or "rope_theta" in params:
        raise r.error(
            "'rope_parameters' must be keyed by layer type ('sliding_attention', "
            "'full_attention'): transformers' Lfm3 looks each type up in it"
        )
    if layer_type not in params:
        raise r.error(f"'rope_parameters' has no entry for layer type {layer_type!r}")
    entry = params[layer_type]
    rope_type = entry.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise r.error(
            f"rope_parameters[{layer_type!r}].rope_type={rope_type!r} is not supported "
            f"(baton runs {', '.join(map(repr, ROPE_TYPES))})"
        )
    if "rope_theta" not in entry:
        raise r.error(f"missing required key 'rope_parameters.{layer_type}.rope_theta'")
    proportional = rope_type == "proportional"
    return Lfm3Rope(
        rope_type=rope_type,
        theta=float(entry["rope_theta"]),
        partial_rotary_factor=float(entry.get("partial_rotary_factor", 1.0))
        if proportional
        else 1.0,
        factor=float(entry.get("factor", 1.0)) if proportional else 1.0,
    )


def inv_freq(rope: Lfm3Rope, head_dim: int) -> torch.Tensor:
    """(head_dim // 2,) float32, computed as transformers 5.25 does: Lfm3RotaryEmbedding's
    default (float arange over whole heads) or `_compute_proportional_rope_parameters` (the
    first int(factor * head_dim // 2) frequencies, zeros after)."""
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float) / head_dim
    rotated = 1.0 / (rope.theta**exponent)
    freq = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)])
    return freq / rope.factor


def read_layers(r: ConfigReader, num_layers: int) -> tuple[Mixer, ...]:
    names = r.hf.get("layer_types")
    if names is None:  # Lfm3Config.__post_init__'s pattern
        names = [
            "full_attention"
            if i % 4 == 2
            else "sliding_attention"
            if i % 4 == 0 and i > 0
            else "conv"
            for i in range(num_layers)
        ]
    if len(names) != num_layers:
        raise r.error(f"'layer_types' lists {len(names)} layers, num_hidden_layers={num_layers}")
    unknown = sorted({n for n in names if n not in MIXERS})
    if unknown:
        raise r.error(f"'layer_types' has unknown layer types {unknown} (LFM3 has {MIXERS})")
    return tuple(names)


def read_config(r: ConfigReader) -> ModelConfig:
    hidden, num_layers = r.need("hidden_size"), r.need("num_hidden_layers")
    heads, kv_heads = r.opt("num_attention_heads"), r.opt("num_key_value_heads")
    r.require_multiple("num_attention_heads", heads, "num_key_value_heads", kv_heads)
    mixers = read_layers(r, num_layers)
    window = r.opt("sliding_window")
    if "sliding_attention" in mixers and (window is None or window < 1):
        raise r.error(f"sliding_window={window!r}: sliding_attention layers need a window >= 1")
    head_dim = r.opt("head_dim") or hidden // heads  # transformers: getattr, else this
    eps = r.hf["rms_norm_eps"] if "rms_norm_eps" in r.hf else r.opt("norm_eps")
    return ModelConfig(
        architecture="Lfm3ForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=Lfm3Config(
            mixers=mixers,
            norm_eps=float(eps),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            attention_bias=bool(r.opt("attention_bias")),
            attention_gate=bool(r.opt("use_attention_gate")),
            sandwich_norm=bool(r.opt("use_sandwich_norm")),
            sliding_window=window if "sliding_attention" in mixers else None,
            rope={kind: read_rope(r, kind) for kind in MIXERS[1:] if kind in mixers},
            conv=ShortConvConfig(
                channels=hidden, conv_kernel=r.opt("conv_L_cache"), bias=bool(r.opt("conv_bias"))
            ),
            intermediate_size=r.opt("intermediate_size"),
        ),
    )


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """A conv window at conv layers; K/V at attention layers, the sliding ones a kind of their
    own that reads `sliding_window` tokens back."""
    lfm = config.family
    uses: list[LayerState] = []
    for kind in lfm.mixers:
        if kind == "conv":
            uses.append(ShortConv.state_spec(lfm.conv, dtype))
        else:
            window = lfm.sliding_window if kind == "sliding_attention" else None
            uses.append(attention_state(lfm.num_kv_heads, lfm.head_dim, dtype, window))
    return ModelStateSpec.of(uses)


def check_tp(config: ModelConfig, size: int) -> None:
    """ConfigError naming the key when a layer cannot split over `size` ranks."""
    lfm = config.family
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    if "conv" in lfm.mixers:
        parallel.split_evenly(lfm.conv.channels, probe, "hidden_size")
    if any(kind != "conv" for kind in lfm.mixers):
        parallel.split_evenly(lfm.num_heads, probe, "num_attention_heads")
        parallel.kv_head_part(lfm.num_kv_heads, lfm.num_heads, probe)
    parallel.split_evenly(lfm.intermediate_size, probe, "intermediate_size")


class GatedAttention(Attention):
    """LFM3's attention: Attention (q/k norms, rotary, the window) whose per-head output is
    scaled by sigmoid(g_proj(x)) before o_proj. Under TP g_proj's rows follow the query heads."""

    def __init__(self, hidden_size: int, lfm: Lfm3Config, kind: Mixer, index: int):
        rope = lfm.rope[kind]
        super().__init__(
            hidden_size=hidden_size,
            num_heads=lfm.num_heads,
            num_kv_heads=lfm.num_kv_heads,
            head_dim=lfm.head_dim,
            bias=lfm.attention_bias,
            scale=lfm.head_dim**-0.5,
            rotary=RotaryConfig(dim=lfm.head_dim, theta=rope.theta),
            kv_index=index,
            qk_norm_eps=lfm.norm_eps,
            sliding_window=lfm.sliding_window if kind == "sliding_attention" else None,
        )
        # transformers' frequencies for this layer type (rotate_half over whole heads; the
        # proportional rope's trailing zeros leave their channels unrotated)
        self.inv_freq = inv_freq(rope, lfm.head_dim)
        self.g_proj: nn.Linear | None = None
        self.qkvg_proj: nn.Module | None = None  # CPU: q, k, v and the gate in one matmul
        if lfm.attention_gate:
            self.g_proj = nn.Linear(hidden_size, self.num_heads, bias=False)
            if self.tp.size > 1:
                first, _ = parallel.split_evenly(lfm.num_heads, self.tp, "num_attention_heads")
                parallel.shard(
                    self.g_proj.weight,
                    parallel.Slices(dim=0, ranges=((first, self.num_heads),)),
                )

    def pack_for_cpu(self) -> None:
        """q, k, v and the gate in one packed matmul (`qkvg_proj`): the gate's few columns
        ride along the q/k/v GEMM instead of a matmul call of their own per layer and step
        (oneDNN's fixed cost per call is most of a 12-column product). Parts stored differently
        (mixed precision, an adapter on some of them) fall back to q/k/v fused alone."""
        if self.g_proj is not None:
            fused = fuse_for_cpu([self.q_proj, self.k_proj, self.v_proj, self.g_proj])
            if fused is not None:
                self.qkvg_proj = fused
                del self.q_proj, self.k_proj, self.v_proj
                self.g_proj = None
                return
        super().pack_for_cpu()

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        if self.qkvg_proj is not None:
            q, k, v, g = self.qkvg_proj(x).split([*self.qkv_sizes, self.num_heads], dim=-1)
        else:
            q, k, v = self.project_qkv(x)
            g = self.g_proj(x) if self.g_proj is not None else None
        out = self.attend(q, k, v, md, cache)
        if g is not None:
            T = out.shape[0]
            gate = torch.sigmoid(g).unsqueeze(-1)
            out = (out.view(T, self.num_heads, self.head_dim) * gate).view(T, -1)
        return self.tp.all_reduce(self.o_proj(out))


class Lfm3Layer(nn.Module):
    """One layer with sandwich norms (Identity when `use_sandwich_norm` is off)."""

    def __init__(self, hidden_size: int, lfm: Lfm3Config, kind: Mixer, index: int, layer: int):
        super().__init__()
        self.mixer_name = "conv" if kind == "conv" else "self_attn"
        mixer = (
            ShortConv(lfm.conv, index)
            if kind == "conv"
            else GatedAttention(hidden_size, lfm, kind, index)
        )
        self.add_module(self.mixer_name, mixer)
        self.operator_norm = RMSNorm(hidden_size, lfm.norm_eps)
        self.ffn_norm = RMSNorm(hidden_size, lfm.norm_eps)
        sandwich = lfm.sandwich_norm
        self.post_operator_norm = RMSNorm(hidden_size, lfm.norm_eps) if sandwich else nn.Identity()
        self.post_ffn_norm = RMSNorm(hidden_size, lfm.norm_eps) if sandwich else nn.Identity()
        self.feed_forward = GatedMLP(hidden_size, lfm.intermediate_size, False, "silu")

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        hidden = hidden + self.post_operator_norm(mixer(self.operator_norm(hidden), md, cache))
        return hidden + self.post_ffn_norm(self.feed_forward(self.ffn_norm(hidden)))


class Lfm3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        lfm, hidden = config.family, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            Lfm3Layer(hidden, lfm, kind, lfm.mixers[:i].count(kind), i)
            for i, kind in enumerate(lfm.mixers)
        )
        self.embedding_norm = RMSNorm(hidden, lfm.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed_tokens(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.embedding_norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, Lfm3Model(config), "embed_tokens")
