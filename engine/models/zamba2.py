"""Zamba2 (`Zamba2ForCausalLM`, Zyphra): a Mamba2 backbone with `num_mem_blocks` shared attention
blocks reused at the `hybrid` layers (block = hybrid ordinal % num_mem_blocks):

    orig = embed(ids); h = orig
    mamba layer:   h = h + mamba(input_layernorm(h))
    hybrid layer:  t = linear(shared(cat[h, orig]));  h = h + mamba(input_layernorm(h + t))
    shared(x):     attn(input_layernorm(x)) -> pre_ff_layernorm -> gated GELU MLP (no residual)

The shared block's weights are stored once (under the first layer that uses it; later uses are
the same module, so they load once; transformers 5 ties them only with tie_word_embeddings,
and so does baton); each use has its own KV pages (kv index = hybrid ordinal)
and, with `use_shared_attention_adapter`, its own LoRA adapters on q/k/v, and always on the
MLP's gate_up_proj. Attention reads 2 x hidden channels, head_dim = 2 x hidden / heads, softmax
scale (head_dim / 2) ** -0.5, rotary over whole heads when `use_mem_rope` (transformers ignores
a partial_rotary_factor). The Mamba2 mixer clamps dt at (time_step_min, inf) as transformers'
prefill does (its decode path does not clamp), and its gated norm uses eps 1e-5 as
transformers' does, whatever rms_norm_eps says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.attention import Attention, AttentionConfig
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.lora import AdapterList
from baton.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from baton.engine.layers.mlp import ACTIVATIONS
from baton.engine.layers.norm import RMSNorm
from baton.engine.models.hybrid import HybridConfig, hybrid_state_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedBlocksConfig:
    """`num_blocks` attention blocks reused in turn at the `hybrid` layers, with per-use LoRA
    adapters of rank `adapter_rank` on q/k/v when `attention_adapters` (the MLP's gate_up_proj
    always has them)."""

    num_blocks: int
    attention_adapters: bool
    adapter_rank: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Zamba2Config:
    hybrid: HybridConfig
    shared_blocks: SharedBlocksConfig


def state_spec(config: ModelConfig, dtype: torch.dtype):
    """Mamba2 state at every layer, K/V at each use of a shared block (`hybrid` layers)."""
    return hybrid_state_spec(config.family.hybrid, dtype)


HF_CONFIG_CLASS_PATH = "transformers.models.zamba2.configuration_zamba2.Zamba2Config"
LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}  # as saved


def read_config(r: ConfigReader) -> ModelConfig:
    hidden = r.need("hidden_size")
    kinds = r.need("layers_block_type")
    unknown = sorted({k for k in kinds if k not in LAYER_KINDS})
    if unknown:
        raise r.error(f"'layers_block_type' has unknown layer types {unknown}")
    num_layers = r.opt("num_hidden_layers")
    if len(kinds) != num_layers:
        raise r.error(
            f"'layers_block_type' lists {len(kinds)} layers, num_hidden_layers={num_layers}"
        )
    act = r.require("hidden_act", ("gelu", "silu"))
    num_heads = r.need("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads")
    head_dim = 2 * hidden // num_heads  # transformers derives it whatever the file says
    n_heads = r.opt("n_mamba_heads")
    intermediate = int(r.opt("mamba_expand") * hidden)
    if intermediate % n_heads:
        raise r.error(f"n_mamba_heads={n_heads} must divide mamba_expand x hidden_size")
    r.require_multiple("n_mamba_heads", n_heads, "mamba_ngroups", r.opt("mamba_ngroups"))
    kv_heads = num_heads if kv_heads is None else kv_heads
    r.require_multiple("num_attention_heads", num_heads, "num_key_value_heads", kv_heads)
    if r.opt("use_shared_attention_adapter") and kv_heads != num_heads:
        # transformers builds the k/v adapters as wide as q (its forward then fails)
        raise r.error(
            f"use_shared_attention_adapter=True needs num_key_value_heads={kv_heads} to equal "
            f"num_attention_heads={num_heads}"
        )
    mlp_bias = bool(r.opt("add_bias_linear"))
    hybrid = HybridConfig(
        layer_types=tuple(LAYER_KINDS[k] for k in kinds),
        norm_eps=float(r.opt("rms_norm_eps")),
        attention=AttentionConfig(
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            bias=False,
            scale=(head_dim / 2) ** -0.5,
            # transformers' Zamba2 rotates whole heads, ignoring any partial_rotary_factor
            rotary=r.rotary(head_dim, partial=False) if r.opt("use_mem_rope") else None,
            key_multiplier=1.0,
        ),
        mamba=Mamba2Config(
            num_heads=n_heads,
            head_dim=intermediate // n_heads,
            state_size=r.opt("mamba_d_state"),
            n_groups=r.opt("mamba_ngroups"),
            conv_kernel=r.opt("mamba_d_conv"),
            chunk_size=r.opt("chunk_size"),
            # transformers' Zamba2 conv1d always has a bias, whatever use_conv_bias says
            conv_bias=True,
            proj_bias=mlp_bias,
            out_proj_bias=mlp_bias,
            time_step_limit=(float(r.opt("time_step_min")), float("inf")),
            norm="gated",
            norm_eps=1e-5,  # transformers' Zamba2 mixer norm, whatever rms_norm_eps says
            cache_dtype="float32",
            in_multiplier=1.0,
            multipliers=(1.0,) * 5,
        ),
        intermediate_size=r.need("intermediate_size"),
        mlp_bias=mlp_bias,
        mlp_hidden_act=act,
        moe=None,
    )
    return ModelConfig(
        architecture="Zamba2ForCausalLM",
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=Zamba2Config(
            hybrid=hybrid,
            shared_blocks=SharedBlocksConfig(
                num_blocks=int(r.opt("num_mem_blocks")),
                attention_adapters=bool(r.opt("use_shared_attention_adapter")),
                adapter_rank=int(r.opt("adapter_rank")),
            ),
        ),
    )


class SharedMLP(nn.Module):
    def __init__(self, config: ModelConfig, adapter_rank: int, owned: list[bool]):
        super().__init__()
        H, inter, bias = (
            config.hidden_size,
            config.family.hybrid.intermediate_size,
            config.family.hybrid.mlp_bias,
        )
        self.act = ACTIVATIONS[config.family.hybrid.mlp_hidden_act]
        self.gate_up_proj = nn.Linear(H, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, H, bias=bias)
        self.gate_up_proj_adapter_list = AdapterList(H, 2 * inter, adapter_rank, owned)

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list.delta(use, x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SharedAttention(Attention):
    """Attention over 2 x hidden input channels, with per-use q/k/v adapters and KV pools."""

    def __init__(self, config: ModelConfig, adapters: bool, adapter_rank: int, owned: list[bool]):
        width = 2 * config.hidden_size
        super().__init__(
            hidden_size=width,
            num_heads=config.family.hybrid.attention.num_heads,
            num_kv_heads=config.family.hybrid.attention.num_kv_heads,
            head_dim=config.family.hybrid.attention.head_dim,
            bias=False,
            scale=config.family.hybrid.attention.scale,
            rotary=config.family.hybrid.attention.rotary,
            kv_index=-1,  # never used: each call names its use's pool
        )
        self.o_proj = nn.Linear(
            config.family.hybrid.attention.num_heads * config.family.hybrid.attention.head_dim,
            config.hidden_size,
            bias=False,
        )
        self.adapters = adapters
        if adapters:
            q_out = (
                config.family.hybrid.attention.num_heads * config.family.hybrid.attention.head_dim
            )
            kv_out = (
                config.family.hybrid.attention.num_kv_heads
                * config.family.hybrid.attention.head_dim
            )
            self.linear_q_adapter_list = AdapterList(width, q_out, adapter_rank, owned)
            self.linear_k_adapter_list = AdapterList(width, kv_out, adapter_rank, owned)
            self.linear_v_adapter_list = AdapterList(width, kv_out, adapter_rank, owned)

    def pack_for_cpu(self) -> None:
        """q/k/v stay separate: each use adds its own adapter term to each of them."""

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache, use: int):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.adapters:
            q = q + self.linear_q_adapter_list.delta(use, x)
            k = k + self.linear_k_adapter_list.delta(use, x)
            v = v + self.linear_v_adapter_list.delta(use, x)
        return self.o_proj(self.attend(q, k, v, md, cache, kv_index=use))


class SharedTransformer(nn.Module):
    def __init__(self, config: ModelConfig, adapters: bool, adapter_rank: int, owned: list[bool]):
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(2 * H, config.family.hybrid.norm_eps)
        self.self_attn = SharedAttention(config, adapters, adapter_rank, owned)
        self.pre_ff_layernorm = RMSNorm(H, config.family.hybrid.norm_eps)
        self.feed_forward = SharedMLP(config, adapter_rank, owned)

    def forward(self, hidden, original, md: Mamba2Metadata, cache: StateCache, use: int):
        x = self.input_layernorm(torch.cat([hidden, original], dim=-1))
        x = self.self_attn(x, md, cache, use)
        return self.feed_forward(self.pre_ff_layernorm(x), use)


class MambaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.family.hybrid.norm_eps)
        self.mamba = Mamba2Mixer(
            config.hidden_size,
            config.family.hybrid.mamba,
            config.family.hybrid.mamba_layer_ids.index(layer_id),
        )

    def forward(self, hidden, md: Mamba2Metadata, cache: StateCache, added=None):
        x = hidden if added is None else hidden + added
        return hidden + self.mamba(self.input_layernorm(x), md, cache)


class HybridLayer(nn.Module):
    def __init__(self, shared: SharedTransformer, config: ModelConfig, layer_id: int, use: int):
        super().__init__()
        self.use = use
        self.shared_transformer = shared  # the same module object at every use of the block
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = MambaLayer(config, layer_id)

    def forward(self, hidden, original, md: Mamba2Metadata, cache: StateCache):
        shared = self.shared_transformer(hidden, original, md, cache, self.use)
        return self.mamba_decoder(hidden, md, cache, added=self.linear(shared))


class Zamba2Model(nn.Module):
    def __init__(self, config: ModelConfig, num_mem_blocks: int, adapters: bool, rank: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        uses = config.family.hybrid.attention_layer_ids  # the hybrid layers, in order
        blocks: dict[int, SharedTransformer] = {}
        tied = config.tie_word_embeddings
        layers = []
        for i, kind in enumerate(config.family.hybrid.layer_types):
            if kind == "mamba":
                layers.append(MambaLayer(config, i))
                continue
            use = uses.index(i)
            block = use % num_mem_blocks
            owned = [u % num_mem_blocks == block for u in range(len(uses))]
            if block not in blocks:
                blocks[block] = SharedTransformer(config, adapters, rank, owned)
            # transformers 5 applies Zamba2's block ties (`_tied_weights_keys`) only when
            # tie_word_embeddings is set; otherwise every use is its own block, with its own
            # tensors in the checkpoint. Run what transformers runs.
            shared = blocks[block] if tied else SharedTransformer(config, adapters, rank, owned)
            layers.append(HybridLayer(shared, config, i, use))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(config.hidden_size, config.family.hybrid.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        original = self.embed_tokens(md.forward.batch.input_ids)
        hidden = original
        for layer in self.layers:
            if isinstance(layer, HybridLayer):
                hidden = layer(hidden, original, md, cache)
            else:
                hidden = layer(hidden, md, cache)
        return self.final_layernorm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        shared = config.family.shared_blocks
        assert shared is not None  # read_config always sets it
        backbone = Zamba2Model(
            config, shared.num_blocks, shared.attention_adapters, shared.adapter_rank
        )
        super().__init__(config, backbone, "embed_tokens")
