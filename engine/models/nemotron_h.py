"""NemotronH (hybrid Mamba2 + attention + MLP) as a packed varlen forward.

Plain single-device math over a packed batch of sequences (no padding between sequences), with
per-sequence conv/SSM state in the Mamba pool and K/V in the paged KV pool. Parameter names match
the Hugging Face checkpoint (`model.` prefix in memory) so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_metadata import Mamba2Metadata
from engine.layers.mlp import ReluSquaredMLP
from engine.layers.moe import MoE
from engine.state_cache import StateCache
from kernels import cpu_ops
from kernels.attention import paged_attention, store_kv
from kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from kernels.linear import PackedLinear, can_pack, pack_linears
from kernels.norm import gated_rms_norm, rms_norm
from kernels.ssd import ssd_scan
from kernels.ssu import selective_state_update
from kernels.state_copy import copy_states


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.weight_f32: torch.Tensor | None = None  # CPU: cached float32 copy (freeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_f32 if self.weight_f32 is not None else self.weight
        return rms_norm(x, weight, self.eps)

    def freeze(self) -> None:
        self.weight_f32 = self.weight.detach().float().contiguous()


class Attention(nn.Module):
    """GQA without positional encoding (NemotronH attention is NoPE)."""

    def __init__(self, config: ModelConfig, attention_index: int):
        super().__init__()
        self.attention_index = attention_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias, hidden = config.attention_bias, config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.qkv_proj: PackedLinear | None = None  # CPU: q, k, v in one packed matmul
        self.qkv_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]

    def pack_for_cpu(self) -> None:
        """One packed matmul for q, k and v (the three plain projections are dropped)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        fused = nn.Linear(parts[0].in_features, sum(self.qkv_sizes), bias=parts[0].bias is not None)
        fused = fused.to(device=parts[0].weight.device, dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        fused.requires_grad_(False)
        self.qkv_proj = PackedLinear(fused)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        fm = md.forward
        T = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = cache.kv_layer(self.attention_index)
        store_kv(k_cache, v_cache, k, v, fm.slot_mapping)
        nd = fm.batch.num_decode_tokens
        parts = []
        if fm.decode_attention.num_seqs:
            parts.append(paged_attention(q[:nd], k_cache, v_cache, fm.decode_attention, self.scale))
        if fm.prefill_attention.num_seqs:
            parts.append(
                paged_attention(q[nd:], k_cache, v_cache, fm.prefill_attention, self.scale)
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(T, -1))


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; causal conv1d + SiLU on xBC; SSD scan (prefill) or selective
    state update (decode); gated RMSNorm norm(y * silu(z)); out_proj."""

    def __init__(self, config: ModelConfig, mamba_index: int):
        super().__init__()
        self.mamba_index = mamba_index
        self.num_heads = H = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.d_state = config.ssm_state_size
        self.intermediate = config.mamba_intermediate
        self.conv_dim = config.conv_dim
        self.group_size = self.intermediate // self.n_groups
        self.eps = config.norm_eps
        self.dt_limit = config.time_step_limit
        self.in_proj = nn.Linear(
            config.hidden_size, self.intermediate + self.conv_dim + H, bias=config.mamba_proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            config.conv_kernel,
            groups=self.conv_dim,
            bias=config.use_conv_bias,
            padding=config.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.intermediate))
        self.out_proj = nn.Linear(
            self.intermediate, config.hidden_size, bias=config.mamba_proj_bias
        )
        self.frozen: cpu_ops.MambaDecodeParams | None = None

    def split_xbc(self, xbc: torch.Tensor):
        gn = self.n_groups * self.d_state
        x, B, C = xbc.split([self.intermediate, gn, gn], dim=-1)
        T = xbc.shape[0]
        return (
            x.reshape(T, self.num_heads, self.head_dim),
            B.reshape(T, self.n_groups, self.d_state),
            C.reshape(T, self.n_groups, self.d_state),
        )

    def decode_params(self) -> cpu_ops.MambaDecodeParams:
        """Float32 forms of the small parameters the fused CPU decode step reads; cached by
        `freeze()` once the weights are loaded and cast."""
        if self.frozen is not None:
            return self.frozen
        bias = self.conv1d.bias
        return cpu_ops.MambaDecodeParams(
            conv_weight=self.conv1d.weight.squeeze(1).float().contiguous(),
            conv_bias=(
                bias.float().contiguous()
                if bias is not None
                else torch.zeros(self.conv_dim, device=self.conv1d.weight.device)
            ),
            dt_bias=self.dt_bias.float().contiguous(),
            A=-torch.exp(self.A_log.float()),
            D=self.D.float().contiguous(),
            norm_weight=self.norm.weight.float().contiguous(),
        )

    def freeze(self) -> None:
        self.frozen = None
        self.frozen = self.decode_params()

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Decode rows first, then prefill rows; each part ends gated-normed (row-wise)."""
        T = hidden.shape[0]
        nd = md.forward.batch.num_decode_tokens
        conv_pool, ssm_pool = cache.mamba_layer(self.mamba_index)
        zxbcdt = self.in_proj(hidden)
        parts = []
        windows = chunk_states = None
        if nd:
            parts.append(self.decode(zxbcdt[:nd], md, conv_pool, ssm_pool))
        if T > nd:
            normed, windows, chunk_states = self.extend(zxbcdt[nd:], md, conv_pool, ssm_pool)
            parts.append(normed)
        if md.has_mamba_track_mask:
            self.checkpoint(md, conv_pool, ssm_pool, windows, chunk_states)
        return self.out_proj(parts[0] if len(parts) == 1 else torch.cat(parts))

    def decode(self, zxbcdt, md: Mamba2Metadata, conv_pool, ssm_pool) -> torch.Tensor:
        if cpu_ops.mamba_decode_supported(zxbcdt, conv_pool, ssm_pool):
            return cpu_ops.mamba_decode_cpu(
                zxbcdt,
                conv_pool,
                ssm_pool,
                md.decode_slots,
                self.decode_params(),
                self.dt_limit,
                self.eps,
                num_heads=self.num_heads,
                head_dim=self.head_dim,
                n_groups=self.n_groups,
                d_state=self.d_state,
                norm_group=self.group_size,
            )
        z, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        xbc = causal_conv1d_update(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_pool, md.decode_slots
        )
        x, B, C = self.split_xbc(xbc)
        y = selective_state_update(
            ssm_pool,
            x,
            dt,
            -torch.exp(self.A_log.float()),
            B,
            C,
            self.D,
            self.dt_bias,
            md.decode_slots,
            self.dt_limit,
        )
        return self.gate(y, z)

    def extend(self, zxbcdt, md: Mamba2Metadata, conv_pool, ssm_pool):
        """Prefill chunks: varlen conv + SSD scan. Returns (normed rows, conv windows and chunk
        states at the track points, for checkpoints)."""
        z, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        window_tokens = (
            md.track_conv_indices[md.num_decode_tracks :] if md.has_mamba_track_mask else None
        )
        xbc, windows = causal_conv1d_varlen(
            xbc,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            conv_pool,
            md.prefill_slots,
            md.conv_layout,
            window_tokens,
        )
        x, B, C = self.split_xbc(xbc)
        out = ssd_scan(
            x,
            dt,
            -torch.exp(self.A_log.float()),
            B,
            C,
            self.D,
            self.dt_bias,
            ssm_pool[md.prefill_slots],
            md.chunk_layout,
            self.dt_limit,
        )
        ssm_pool[md.prefill_slots] = out.final_states.to(ssm_pool.dtype)
        return self.gate(out.y, z), windows, out.chunk_states

    def gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(
            y.reshape(z.shape[0], self.intermediate), z, self.norm.weight, self.eps, self.group_size
        )

    def checkpoint(self, md, conv_pool, ssm_pool, windows, chunk_states) -> None:
        """Copy the conv window and SSM state at each track point into its checkpoint slot.

        SSM sources are [decode rows' updated states | prefill chunk-end states]; conv sources
        are the decode rows' updated pool windows, then the prefill windows from the conv."""
        ndt = md.num_decode_tracks
        decode_slots = md.decode_slots
        ssm_sources = [ssm_pool[decode_slots]]
        if chunk_states is not None:
            ssm_sources.append(chunk_states.flatten(0, 1))
        ssm_src = torch.cat(ssm_sources) if len(ssm_sources) > 1 else ssm_sources[0]
        copy_states(ssm_pool, md.track_ssm_dst, ssm_src, md.track_ssm_src)
        if ndt:
            rows = md.track_conv_indices[:ndt]
            copy_states(conv_pool, md.track_ssm_dst[:ndt], conv_pool, decode_slots[rows])
        if windows is not None and windows.shape[0]:
            copy_states(
                conv_pool,
                md.track_ssm_dst[ndt:],
                windows,
                torch.arange(windows.shape[0], device=windows.device),
            )


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        kind = config.layer_types[layer_id]
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        # Mamba and attention read and write the pools; MLP and MoE see only their rows.
        self.stateful = kind in ("mamba", "attention")
        if kind == "mamba":
            self.mixer = Mamba2Mixer(config, config.mamba_layer_ids.index(layer_id))
        elif kind == "attention":
            self.mixer = Attention(config, config.attention_layer_ids.index(layer_id))
        elif kind == "mlp":
            self.mixer = ReluSquaredMLP(
                config.hidden_size, config.intermediate_size, config.mlp_bias
            )
        else:
            assert config.moe is not None  # from_dict builds it whenever a layer is `moe`
            self.mixer = MoE(config.hidden_size, config.moe)

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        normed = self.norm(hidden)
        out = self.mixer(normed, md, cache) if self.stateful else self.mixer(normed)
        return hidden + out


class NemotronHModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embeddings(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm_f(hidden)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = NemotronHModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_parameters: tuple[str, ...] = ()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight
            self.tied_parameters = ("lm_head.weight",)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Returns float32 logits for the rows `md.forward.batch.logits_indices`."""
        hidden = self.model(md, cache)
        rows = hidden[md.forward.batch.logits_indices]
        return self.lm_head(rows).float()

    def prepare_for_cpu(self, dtype: torch.dtype) -> None:
        """Prepack every linear weight for oneDNN once (kernels/linear.py): decode's few-row
        matmuls, lm_head above all, run 1.2-3x faster than F.linear repacking on each call.
        Call after the weights are loaded and cast; the plain weights are dropped."""
        if can_pack(dtype):
            for module in list(self.modules()):
                if hasattr(module, "pack_for_cpu"):
                    module.pack_for_cpu()
        pack_linears(self, dtype)
        for module in self.modules():
            if isinstance(module, (Mamba2Mixer, RMSNorm)):
                module.freeze()
