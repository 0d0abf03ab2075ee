"""One gated DeltaNet mixer's math on explicit states, from its projections to the out_proj input.

    qkv  --conv (K taps, no bias) + SiLU-->  q | k | v        (conv state: the last K-1 inputs)
    a, b --gdn_gating-->  g = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b) * beta_scale
    o    = gated delta rule (q, k l2-normalised inside; state per slot (Hv, dk, dv) float32)
    out  = (w * rmsnorm(o)) * silu(z)   per v head: transformers' RMSNormGated, which normalises
                                         *before* the gate, with a plain weight (no 1 + w)

The projections are the families' business (Qwen3-Next packs q|k|v|z and b|a per key head,
Qwen3.5 keeps them apart, OLMo-Hybrid has separate q/k/v/a/b/g projections and three convs on disk
whose weights concatenate to this one depthwise conv): a layer hands over qkv (its conv input in
[q | k | v] order), z, a and b, and gets the out_proj input back. No engine types here: pools,
slots and layouts are plain tensors, so the engine's GDN layer and the tests share this one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.cpu import gated_delta as cpu_gated_delta
from baton.kernels.gated_delta import gated_delta_decode, gated_delta_prefill, gdn_gating
from baton.kernels.layouts import ChunkLayout, ConvLayout
from baton.kernels.verify_steps import token_rows, verify_by_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class GDNMixerDims:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    beta_scale: float  # 2.0 with OLMo-Hybrid's linear_allow_neg_eigval, else 1.0
    norm_eps: float  # the output norm's (OLMo-Hybrid fixes it at 1e-5)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


class GDNMixerWeights(NamedTuple):
    conv_weight: torch.Tensor  # (conv_dim, K) model dtype, channels in [q | k | v] order
    A_log: torch.Tensor  # (Hv,)
    dt_bias: torch.Tensor  # (Hv,)
    norm_weight: torch.Tensor  # (dv,) model dtype

    def decode_params(self) -> cpu_gated_delta.GDNDecodeParams:
        """The float32 copies the fused C decode step reads (build once per layer)."""
        return cpu_gated_delta.GDNDecodeParams(
            conv_weight=self.conv_weight.float().contiguous(),
            A=-self.A_log.float().exp(),
            dt_bias=self.dt_bias.float().contiguous(),
            norm_weight=self.norm_weight.float().contiguous(),
        )


class GDNPrefillOutput(NamedTuple):
    out: torch.Tensor  # (num_tokens, Hv * dv) model dtype: the out_proj input
    chunk_states: torch.Tensor | None  # (num_seqs, num_chunks, Hv, dk, dv) float32, if wanted
    conv_windows: torch.Tensor | None  # (M, conv_dim, K-1) after each of window_tokens


def norm_before_gate(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """transformers' Qwen3NextRMSNormGated / OlmoHybridRMSNormGated over rows of dv.

    o, z: (..., dv) in the model dtype; weight: (dv,). Rounds where it rounds: the normalised
    o to the dtype before the weight, the product with silu(z) (float32) at the end."""
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(o.dtype)) * F.silu(z.float())).to(o.dtype)


def _split_heads(qkv: torch.Tensor, dims: GDNMixerDims):
    Hk, Hv, dk, dv = dims.num_k_heads, dims.num_v_heads, dims.k_head_dim, dims.v_head_dim
    q, k, v = qkv.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    rows = qkv.shape[0]
    return q.view(rows, Hk, dk), k.view(rows, Hk, dk), v.view(rows, Hv, dv)


def gdn_mixer_prefill(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    conv_layout: ConvLayout,
    chunk_layout: ChunkLayout,
    weights: GDNMixerWeights,
    dims: GDNMixerDims,
    *,
    want_chunk_states: bool,
    window_tokens: torch.Tensor | None,
) -> GDNPrefillOutput:
    """Prefill of packed sequences continuing from (and updating) their pool slots.

    qkv: (num_tokens, conv_dim); z: (num_tokens, Hv * dv); a, b: (num_tokens, Hv), model dtype;
    conv_states: (num_slots, conv_dim, K-1); state_pool: (num_slots, Hv, dk, dv) float32;
    state_indices: (num_seqs,) int64; conv_layout: baton.kernels.conv1d.build_window_layout(seq_lens,
    K, device); chunk_layout: baton.kernels.ssd.build_chunk_layout(seq_lens, start_pos, chunk, device);
    window_tokens: packed token indices whose conv windows a checkpoint keeps, or None."""
    x, windows = causal_conv1d_varlen(
        qkv, weights.conv_weight, None, conv_states, state_indices, conv_layout, window_tokens
    )
    q, k, v = _split_heads(x, dims)
    g, beta = gdn_gating(a, b, weights.A_log, weights.dt_bias, dims.beta_scale)
    o, chunk_states = gated_delta_prefill(
        q, k, v, g, beta, state_pool, state_indices, chunk_layout, want_chunk_states
    )
    dv = dims.v_head_dim
    out = norm_before_gate(o, z.view(o.shape), weights.norm_weight, dims.norm_eps)
    return GDNPrefillOutput(
        out=out.view(-1, dims.num_v_heads * dv), chunk_states=chunk_states, conv_windows=windows
    )


def gdn_mixer_decode(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    weights: GDNMixerWeights,
    dims: GDNMixerDims,
    decode_params: cpu_gated_delta.GDNDecodeParams | None,
) -> torch.Tensor:
    """One decode step per request (rows of slot 0 are padding), both pools updated in place.

    Shapes as gdn_mixer_prefill's with batch rows for tokens; state_indices: (batch,) int64.
    decode_params: `weights.decode_params()` to run the fused C step on the CPU where it is
    supported, None for the composite path. Returns (batch, Hv * dv) in the model dtype."""
    if decode_params is not None and cpu_gated_delta.gdn_decode_supported(
        qkv, conv_states, state_pool
    ):
        return cpu_gated_delta.gdn_decode_cpu(
            qkv, z, a, b, conv_states, state_pool, state_indices, decode_params,
            beta_scale=dims.beta_scale, eps=dims.norm_eps, num_k_heads=dims.num_k_heads,
        )  # fmt: skip
    x = causal_conv1d_update(qkv, weights.conv_weight, None, conv_states, state_indices)
    q, k, v = _split_heads(x, dims)
    g, beta = gdn_gating(a, b, weights.A_log, weights.dt_bias, dims.beta_scale)
    o = gated_delta_decode(q, k, v, g, beta, state_pool, state_indices)
    out = norm_before_gate(o, z.view(o.shape), weights.norm_weight, dims.norm_eps)
    return out.view(-1, dims.num_v_heads * dims.v_head_dim)


def gdn_mixer_verify(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    weights: GDNMixerWeights,
    dims: GDNMixerDims,
    decode_params: cpu_gated_delta.GDNDecodeParams | None,
) -> torch.Tensor:
    """Speculative verify: q tokens per request, rows request-major (nv * q of them, shapes as
    gdn_mixer_decode's), slots: (nv, q + 1) int64, column 0 the slot read, column i + 1 the slot
    that keeps both states after token i (rollback is choosing one of them).

    Token i is one decode step on slot column i + 1 after copying column i's states into it:
    the decode step's own kernels (the fused C step on the CPU), so each kept state is the one
    plain decoding would have left there."""
    q = slots.shape[1] - 1

    def decode_token(i: int, dst: torch.Tensor) -> torch.Tensor:
        rows = [token_rows(t, i, q) for t in (qkv, z, a, b)]
        return gdn_mixer_decode(*rows, conv_states, state_pool, dst, weights, dims, decode_params)

    return verify_by_steps(slots, (conv_states, state_pool), decode_token)
