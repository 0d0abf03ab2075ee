"""Naive token-by-token references for the kernels (slow, obviously right)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_oracle(x, dt, A, B, C, D, dt_bias, init, seq_lens, dt_limit=(0.0, float("inf"))):
    """Token-by-token recurrence per sequence. Returns y (T,H,P), final (S,H,P,N), and
    states_after[s][j] = state after token j of sequence s."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    R = H // G
    dt = F.softplus(dt.double() + dt_bias.double()).clamp(*dt_limit)
    y = torch.zeros(T, H, P, dtype=torch.float64)
    finals, per_token = [], []
    t = 0
    for s, n in enumerate(seq_lens):
        h = init[s].double().clone()
        states = []
        for _ in range(n):
            Bh = B[t].double().repeat_interleave(R, 0)  # (H, N)
            Ch = C[t].double().repeat_interleave(R, 0)
            h = (
                h * torch.exp(dt[t] * A.double())[:, None, None]
                + (dt[t][:, None] * x[t].double())[:, :, None] * Bh[:, None, :]
            )
            y[t] = torch.einsum("hpn,hn->hp", h, Ch) + D.double()[:, None] * x[t].double()
            states.append(h.clone())
            t += 1
        finals.append(h)
        per_token.append(states)
    return y, torch.stack(finals), per_token


def conv_oracle(x, weight, bias, init, seq_lens, activation="silu"):
    """Per token: out = act(sum_k w[:, k] * window[k]); window = last K inputs incl. current;
    act SiLU, or nothing for activation "none"."""
    T, dim = x.shape
    out = torch.zeros(T, dim, dtype=torch.float64)
    finals, windows = [], []
    t = 0
    for s, n in enumerate(seq_lens):
        hist = init[s].double().clone()  # (dim, K-1)
        per_tok = []
        for _ in range(n):
            window = torch.cat([hist, x[t].double()[:, None]], dim=1)
            o = (window * weight.double()).sum(1)
            if bias is not None:
                o = o + bias.double()
            out[t] = F.silu(o) if activation == "silu" else o
            hist = window[:, 1:]
            per_tok.append(hist.clone())
            t += 1
        finals.append(hist)
        windows.append(per_tok)
    return out, torch.stack(finals), windows


def selective_scan_oracle(x, dt, A, B, C, D, dt_bias, z, init, seq_lens):
    """Mamba1, token by token per sequence: delta = softplus(dt + dt_bias);
    h = exp(delta A) h + (delta x) B; y = h . C + D x (times silu(z) when z is given).
    Returns y (T, d_inner), final states (S, d_inner, d_state) and states_after[s][j], the
    state after token j of sequence s (float64)."""
    delta = F.softplus(dt.double() + dt_bias.double())
    y = torch.zeros(x.shape, dtype=torch.float64)
    finals, per_token = [], []
    t = 0
    for s, n in enumerate(seq_lens):
        h = init[s].double().clone()
        states = []
        for _ in range(n):
            decay = torch.exp(delta[t][:, None] * A.double())
            h = decay * h + (delta[t] * x[t].double())[:, None] * B[t].double()[None, :]
            y[t] = h @ C[t].double() + D.double() * x[t].double()
            if z is not None:
                y[t] = y[t] * F.silu(z[t].double())
            states.append(h.clone())
            t += 1
        finals.append(h)
        per_token.append(states)
    return y, torch.stack(finals), per_token


def attention_oracle(q, keys, values, scale):
    """q: (Q, H, D) queries at the last Q positions of keys/values (L, KVH, D); causal."""
    Q, H, Dh = q.shape
    L, KVH, _ = keys.shape
    rep = H // KVH
    out = torch.zeros(Q, H, Dh, dtype=torch.float64)
    for i in range(Q):
        pos = L - Q + i
        for h in range(H):
            k = keys[: pos + 1, h // rep].double()
            v = values[: pos + 1, h // rep].double()
            w = torch.softmax((k @ q[i, h].double()) * scale, dim=0)
            out[i, h] = w @ v
    return out


def gated_delta_oracle(q, k, v, g, beta, init, seq_lens):
    """Gated delta rule token by token in float64, per sequence (kernels/gated_delta.py's
    formulas). q, k: (T, Hk, dk); v: (T, Hv, dv); g, beta: (T, Hv); init: (S, Hv, dk, dv).
    Returns o (T, Hv, dv), final (S, Hv, dk, dv) and states_after[s][j] = state after token j."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    R = Hv // Hk

    def unit(x):
        x = x.double()
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    qn = unit(q).repeat_interleave(R, 1) / dk**0.5
    kn = unit(k).repeat_interleave(R, 1)
    o = torch.zeros(T, Hv, dv, dtype=torch.float64)
    finals, per_token = [], []
    t = 0
    for s, n in enumerate(seq_lens):
        state = init[s].double().clone()  # (Hv, dk, dv)
        states = []
        for _ in range(n):
            state = state * torch.exp(g[t].double())[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", kn[t], state)
            delta = (v[t].double() - predicted) * beta[t].double()[:, None]
            state = state + kn[t][:, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qn[t], state)
            states.append(state.clone())
            t += 1
        finals.append(state)
        per_token.append(states)
    return o, torch.stack(finals), per_token
