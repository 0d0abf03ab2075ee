"""One Kimi Delta Attention mixer's math on explicit states, from its projections to the o_proj
input (transformers 5.25's KimiLinearDeltaAttention):

    qkv   --conv (K taps, no bias) + SiLU-->  q | k | v     (conv state: the last K-1 inputs)
    f     --kda_gate-->  g = -exp(A_log) softplus(f + dt_bias)   per key channel (heads, dk)
                         (Bailing's bounded form: lb sigmoid(exp(A_log) (f + dt_bias)))
    b     --sigmoid-->   beta                                    per head
    o     = KDA (kernels/kda.py; state per slot (heads, dk, dv) float32)
    out   = w * rmsnorm(o) * sigmoid(gate)   per head, all in float32 (transformers'
                                             KimiLinearRMSNormGated), cast back at the end

The projections are the layer's business (engine/layers/kda.py): it hands over qkv (the conv
input in [q | k | v] order), f (f_b_proj(f_a_proj(x))), b (b_proj(x)) and gate
(g_b_proj(g_a_proj(x))). No engine types here: pools, slots and layouts are plain tensors, so the
engine layer and the tests share this one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from baton.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.cpu import kda as cpu_kda
from baton.kernels.kda import kda_decode, kda_gate, kda_prefill
from baton.kernels.layouts import ChunkLayout, ConvLayout
from baton.kernels.verify_steps import token_rows, verify_by_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class KDAMixerDims:
    num_heads: int  # this rank's
    head_dim: int  # dk = dv
    norm_eps: float  # of the output norm (rms_norm_eps)
    gate_lower_bound: float | None  # Bailing's bounded decay (kernels/kda.py: kda_gate)

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim


class KDAMixerWeights(NamedTuple):
    conv_weight: torch.Tensor  # (3 * width, K) model dtype, channels in [q | k | v] order
    A_log: torch.Tensor  # (heads,)
    dt_bias: torch.Tensor  # (width,)
    norm_weight: torch.Tensor  # (head_dim,)

    def decode_params(self) -> cpu_kda.KDADecodeParams:
        """The float32 copies the fused C decode step reads (build once per layer)."""
        return cpu_kda.KDADecodeParams(
            conv_weight=self.conv_weight.float().contiguous(),
            A=-self.A_log.float().exp(),
            dt_bias=self.dt_bias.float().contiguous(),
            norm_weight=self.norm_weight.float().contiguous(),
        )


class KDAPrefillOutput(NamedTuple):
    out: torch.Tensor  # (num_tokens, width) model dtype: the o_proj input
    chunk_states: torch.Tensor  # (num_seqs, num_chunks, heads, dk, dv) float32
    conv_windows: torch.Tensor | None  # (M, 3 * width, K-1) after each of window_tokens


def gated_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """transformers' KimiLinearRMSNormGated over rows of head_dim: o, gate (..., head_dim) in the
    model dtype; the norm, the weight and the sigmoid gate in float32, cast back once."""
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(o.dtype)


def _heads(qkv: torch.Tensor, f, b, weights: KDAMixerWeights, dims: KDAMixerDims):
    """(q, k, v) as (rows, heads, head_dim), g (rows, heads, dk) float32, beta (rows, heads)."""
    rows, H, d = qkv.shape[0], dims.num_heads, dims.head_dim
    q, k, v = (t.view(rows, H, d) for t in qkv.split(dims.width, dim=-1))
    g = kda_gate(f, weights.A_log, weights.dt_bias, d, dims.gate_lower_bound)
    return q, k, v, g, torch.sigmoid(b).float()


def kda_mixer_prefill(
    qkv: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    gate: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    conv_layout: ConvLayout,
    chunk_layout: ChunkLayout,
    weights: KDAMixerWeights,
    dims: KDAMixerDims,
    *,
    window_tokens: torch.Tensor | None,
) -> KDAPrefillOutput:
    """Prefill of packed sequences continuing from (and updating) their pool slots.

    qkv: (num_tokens, 3 * width); f, gate: (num_tokens, width); b: (num_tokens, heads), model
    dtype; conv_states: (num_slots, 3 * width, K-1); state_pool: (num_slots, heads, dk, dv)
    float32; state_indices: (num_seqs,) int64; conv_layout: build_window_layout(seq_lens, K,
    device); chunk_layout: build_chunk_layout(seq_lens, start_pos, chunk, device);
    window_tokens: packed token indices whose conv windows a checkpoint keeps, or None."""
    x, windows = causal_conv1d_varlen(
        qkv, weights.conv_weight, None, conv_states, state_indices, conv_layout, window_tokens
    )
    q, k, v, g, beta = _heads(x, f, b, weights, dims)
    o, chunk_states = kda_prefill(q, k, v, g, beta, state_pool, state_indices, chunk_layout)
    out = gated_norm(o, gate.view(o.shape), weights.norm_weight, dims.norm_eps)
    return KDAPrefillOutput(
        out=out.view(-1, dims.width), chunk_states=chunk_states, conv_windows=windows
    )


def kda_mixer_decode(
    qkv: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    gate: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    weights: KDAMixerWeights,
    dims: KDAMixerDims,
    decode_params: cpu_kda.KDADecodeParams | None,
) -> torch.Tensor:
    """One decode step per request (rows of slot 0 are padding), both pools updated in place.
    Shapes as kda_mixer_prefill's with batch rows for tokens; state_indices: (batch,) int64.
    decode_params: `weights.decode_params()` to run the fused C step on the CPU where it is
    supported, None for the composite path. Returns (batch, width) in the model dtype."""
    if decode_params is not None and cpu_kda.kda_mixer_decode_supported(
        qkv, conv_states, state_pool
    ):
        return cpu_kda.kda_mixer_decode_cpu(
            qkv, f, b, gate, conv_states, state_pool, state_indices, decode_params,
            eps=dims.norm_eps, gate_lower_bound=dims.gate_lower_bound,
        )  # fmt: skip
    x = causal_conv1d_update(qkv, weights.conv_weight, None, conv_states, state_indices)
    q, k, v, g, beta = _heads(x, f, b, weights, dims)
    o = kda_decode(q, k, v, g, beta, state_pool, state_indices)
    return gated_norm(o, gate.view(o.shape), weights.norm_weight, dims.norm_eps).view(
        -1, dims.width
    )


def kda_mixer_verify(
    qkv: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    gate: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    weights: KDAMixerWeights,
    dims: KDAMixerDims,
    decode_params: cpu_kda.KDADecodeParams | None,
) -> torch.Tensor:
    """Speculative verify: q tokens per request, rows request-major, slots (nv, q + 1) int64
    (kernels/verify_steps.py): token i is one decode step on slot column i + 1."""
    q = slots.shape[1] - 1

    def decode_token(i: int, dst: torch.Tensor) -> torch.Tensor:
        rows = [token_rows(t, i, q) for t in (qkv, f, b, gate)]
        return kda_mixer_decode(*rows, conv_states, state_pool, dst, weights, dims, decode_params)

    return verify_by_steps(slots, (conv_states, state_pool), decode_token)
