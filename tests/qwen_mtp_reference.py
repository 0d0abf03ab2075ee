"""A plain torch reference of the Qwen MTP layer, written from its definition (vLLM's
qwen3_next_mtp / qwen3_5_mtp and transformers' Qwen3-Next / Qwen3.5 decoder layer) over the
checkpoint's tensors, in float64; none of baton's layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def zc_rms(x, weight, eps):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.double())


def rotate(x, positions, rotary):
    """NeoX rotary on each head's first channels: x (T, heads, hd)."""
    inv_freq = rotary.theta ** (-torch.arange(0, rotary.dim, 2, dtype=torch.float64) / rotary.dim)
    n = 2 * inv_freq.numel()
    angles = positions[:, None, None].double() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : n // 2], x[..., n // 2 : n]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., n:]], dim=-1)


def gated_attention_ref(x, w, prefix, attention, eps, positions):
    """q_proj rows per head [q | gate]; per-head zero-centred q/k norms; partial rotary; causal
    GQA; output * sigmoid(gate), then o_proj."""
    T, heads, kv, hd = x.shape[0], attention.num_heads, attention.num_kv_heads, attention.head_dim
    qg = (x @ w[f"{prefix}.q_proj.weight"].double().T).view(T, heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, heads * hd)
    k = (x @ w[f"{prefix}.k_proj.weight"].double().T).view(T, kv, hd)
    v = (x @ w[f"{prefix}.v_proj.weight"].double().T).view(T, kv, hd)
    q = rotate(zc_rms(q, w[f"{prefix}.q_norm.weight"], eps), positions, attention.rotary)
    k = rotate(zc_rms(k, w[f"{prefix}.k_norm.weight"], eps), positions, attention.rotary)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, heads * hd)
    return (out * torch.sigmoid(gate)) @ w[f"{prefix}.o_proj.weight"].double().T


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.double().T) * (x @ up.double().T)) @ down.double().T


def expert(w, prefix, e):
    """(gate, up, down) of expert e: stacked as the Qwen3.5-MoE releases, or one per tensor."""
    if f"{prefix}.experts.gate_up_proj" in w:
        gate, up = w[f"{prefix}.experts.gate_up_proj"][e].chunk(2, dim=0)
        return gate, up, w[f"{prefix}.experts.down_proj"][e]
    return tuple(w[f"{prefix}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))


def moe_ref(x, w, prefix, moe):
    """Softmax router, top-k (renormalised when norm_topk_prob), SwiGLU experts, plus the shared
    expert scaled by sigmoid(shared_expert_gate)."""
    probs = (x @ w[f"{prefix}.gate.weight"].double().T).softmax(-1)
    weights, choice = probs.topk(moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(choice[t].tolist()):
            out[t] += weights[t, slot] * swiglu(x[t : t + 1], *expert(w, prefix, e))[0]
    s = f"{prefix}.shared_expert"
    shared = swiglu(x, *(w[f"{s}.{p}_proj.weight"] for p in ("gate", "up", "down")))
    return out + shared * torch.sigmoid(x @ w[f"{prefix}.shared_expert_gate.weight"].double().T)


def mtp_reference(config, w, embeds, hidden, positions):
    """embeds: the next tokens' embeddings, hidden: the target's final hidden states, (T, H)
    each, at `positions`; returns the MTP layer's output hidden states (T, H) in float64."""
    qwen, eps, p = config.family, config.family.norm_eps, "mtp.layers.0"
    fused = torch.cat(
        [
            zc_rms(embeds.double(), w["mtp.pre_fc_norm_embedding.weight"], eps),
            zc_rms(hidden.double(), w["mtp.pre_fc_norm_hidden.weight"], eps),
        ],
        dim=-1,
    )
    x = fused @ w["mtp.fc.weight"].double().T
    normed = zc_rms(x, w[f"{p}.input_layernorm.weight"], eps)
    x = x + gated_attention_ref(normed, w, f"{p}.self_attn", qwen.attention, eps, positions)
    normed = zc_rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    if f"{p}.mlp.gate.weight" in w:  # the router: an MoE layer
        x = x + moe_ref(normed, w, f"{p}.mlp", qwen.moe)
    else:
        x = x + swiglu(normed, *(w[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
    return zc_rms(x, w["mtp.norm.weight"], eps)
