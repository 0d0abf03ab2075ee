"""A whole gated DeltaNet mixer (kernels/gdn_mixer.py) against transformers' Qwen3-Next and
OLMo-Hybrid mixer modules, and the fused C decode step against the composite path."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.conv1d import build_window_layout
from baton.kernels.cpu import gated_delta as cpu_gated_delta
from baton.kernels.gdn_mixer import (
    GDNMixerDims,
    GDNMixerWeights,
    gdn_mixer_decode,
    gdn_mixer_prefill,
)
from baton.kernels.ssd import build_chunk_layout

HIDDEN, K = 32, 4


def hf_mixer(family: str, Hk: int, Hv: int, dk: int, dv: int):
    """A transformers GDN mixer with random weights (fixed seed), fp32, and its projections as
    the mixer function takes them: hidden (T, hidden) -> (qkv, z, a, b)."""
    torch.manual_seed(0)
    common = dict(
        hidden_size=HIDDEN, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=K,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        module = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**common), 0)
        norm, out_proj = module.norm, module.out_proj

        def project(h):
            q, k, v, z, b, a = module.fix_query_key_value_ordering(
                module.in_proj_qkvz(h[None]), module.in_proj_ba(h[None])
            )
            qkv = torch.cat([t.reshape(h.shape[0], -1) for t in (q[0], k[0], v[0])], dim=-1)
            return qkv, z[0].reshape(h.shape[0], -1), a[0], b[0]

        beta_scale, eps = 1.0, module.layer_norm_epsilon
    else:
        from transformers import OlmoHybridConfig
        from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

        module = OlmoHybridGatedDeltaNet(
            OlmoHybridConfig(**common, linear_allow_neg_eigval=True), 0
        )
        norm, out_proj = module.o_norm, module.o_proj

        def project(h):
            qkv = torch.cat([module.q_proj(h), module.k_proj(h), module.v_proj(h)], dim=-1)
            return qkv, module.g_proj(h), module.a_proj(h), module.b_proj(h)

        beta_scale, eps = 2.0, norm.variance_epsilon
    with torch.no_grad():  # the defaults (ones) would hide a weight applied at the wrong place
        norm.weight.uniform_(0.5, 1.5)
        module.dt_bias.normal_()
    weights = GDNMixerWeights(
        conv_weight=module.conv1d.weight.detach()[:, 0],
        A_log=module.A_log.detach(),
        dt_bias=module.dt_bias.detach(),
        norm_weight=norm.weight.detach(),
    )
    dims = GDNMixerDims(num_k_heads=Hk, num_v_heads=Hv, k_head_dim=dk, v_head_dim=dv,
                        beta_scale=beta_scale, norm_eps=eps)  # fmt: skip
    return module, out_proj, project, weights, dims


def pools(dims: GDNMixerDims, num_slots: int):
    conv = torch.zeros(num_slots, dims.conv_dim, K - 1)
    state = torch.zeros(num_slots, dims.num_v_heads, dims.k_head_dim, dims.v_head_dim)
    return conv, state


FAMILIES = [("qwen3_next", 2, 4, 8, 6), ("olmo_hybrid", 3, 3, 12, 20)]


@pytest.mark.parametrize("family,Hk,Hv,dk,dv", FAMILIES)
@torch.no_grad()
def test_prefill_then_decode_matches_transformers_mixer(family, Hk, Hv, dk, dv):
    module, out_proj, project, weights, dims = hf_mixer(family, Hk, Hv, dk, dv)
    seq_lens = [13, 6]
    hidden = torch.randn(sum(seq_lens), HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = torch.cat([module(h[None])[0] for h in hidden.split(seq_lens)])
    # Prefill all but each sequence's last token, then decode the last tokens as one batch.
    prompt = [n - 1 for n in seq_lens]
    starts = torch.tensor([0, seq_lens[0]])
    keep = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), prompt)])
    last = starts + torch.tensor(seq_lens) - 1
    for decode_params in (weights.decode_params(), None):  # fused C step, composite path
        conv, state = pools(dims, 4)
        slots = torch.tensor([3, 1])
        qkv, z, a, b = project(hidden[keep])
        out = gdn_mixer_prefill(
            qkv, z, a, b, conv, state, slots, build_window_layout(prompt, K, "cpu"),
            build_chunk_layout(prompt, [0, 0], 4, "cpu"), weights, dims,
            want_chunk_states=False, window_tokens=None,
        )  # fmt: skip
        torch.testing.assert_close(out_proj(out.out), expected[keep], atol=1e-5, rtol=1e-4)
        qkv, z, a, b = project(hidden[last])
        step = gdn_mixer_decode(qkv, z, a, b, conv, state, slots, weights, dims, decode_params)
        torch.testing.assert_close(out_proj(step), expected[last], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_prefill_resumed_mid_chunk_equals_one_prefill():
    _, _, project, weights, dims = hf_mixer("qwen3_next", 2, 4, 8, 6)
    hidden = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(2))
    qkv, z, a, b = project(hidden)

    def run(pieces: list[int]):
        conv, state = pools(dims, 2)
        outs, pos = [], 0
        for n in pieces:
            sl = slice(pos, pos + n)
            outs.append(gdn_mixer_prefill(
                qkv[sl], z[sl], a[sl], b[sl], conv, state, torch.tensor([1]),
                build_window_layout([n], K, "cpu"), build_chunk_layout([n], [pos], 8, "cpu"),
                weights, dims, want_chunk_states=False, window_tokens=None,
            ).out)  # fmt: skip
            pos += n
        return torch.cat(outs), conv[1], state[1]

    for whole, resumed in zip(run([23]), run([11, 12])):
        torch.testing.assert_close(resumed, whole, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(cpu_gated_delta.library() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,Hk,Hv,dk,dv", FAMILIES)
def test_fused_c_decode_matches_composite_path(family, Hk, Hv, dk, dv, dtype):
    _, _, _, weights, dims = hf_mixer(family, Hk, Hv, dk, dv)
    weights = GDNMixerWeights(*(w.to(dtype) if w is not weights.A_log else w for w in weights))
    gen = torch.Generator().manual_seed(3)
    batch, num_slots = 4, 6
    qkv = torch.randn(batch, dims.conv_dim + 5, generator=gen).to(dtype)[:, 2:-3]  # a view
    z = torch.randn(batch, Hv * dv, generator=gen).to(dtype)
    ab = torch.randn(batch, 2 * Hv, generator=gen).to(dtype)
    a, b = ab[:, :Hv], ab[:, Hv:]
    conv = torch.randn(num_slots, dims.conv_dim, K - 1, generator=gen).to(dtype)
    state = torch.randn(num_slots, Hv, dk, dv, generator=gen) * 0.3
    slots = torch.tensor([4, 0, 1, 5])  # row 1 pads the batch
    fused_conv, fused_state = conv.clone(), state.clone()
    fused = gdn_mixer_decode(
        qkv, z, a, b, fused_conv, fused_state, slots, weights, dims, weights.decode_params()
    )
    composite = gdn_mixer_decode(qkv, z, a, b, conv, state, slots, weights, dims, None)
    assert fused.dtype == dtype and fused.shape == (batch, Hv * dv)
    tight = dtype == torch.float32
    close = dict(atol=1e-5, rtol=1e-4) if tight else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused.float(), composite.float(), **close)
    live = torch.tensor([4, 1, 5])
    torch.testing.assert_close(fused_conv[live], conv[live], atol=0, rtol=0)
    # bf16: the fused step rounds the conv output before its SiLU, as transformers does; the
    # conv update's C path rounds once after it: q, k, v may differ by an ulp.
    torch.testing.assert_close(fused_state, state, atol=1e-5 if tight else 1e-2, rtol=1e-4)
    assert torch.equal(fused[1], torch.zeros_like(fused[1]))


@pytest.mark.skipif(cpu_gated_delta.library() is None, reason="no C compiler")
def test_fused_c_decode_rejects_bad_slots_and_shapes():
    _, _, _, weights, dims = hf_mixer("qwen3_next", 2, 4, 8, 6)
    conv, state = pools(dims, 3)
    qkv, z = torch.randn(2, dims.conv_dim), torch.randn(2, 24)
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    params = weights.decode_params()
    before = state.clone()
    with pytest.raises(IndexError, match="slot index 3 of row 1 is outside the pool of 3"):
        gdn_mixer_decode(qkv, z, a, b, conv, state, torch.tensor([1, 3]), weights, dims, params)
    assert torch.equal(state, before)
    with pytest.raises(ValueError, match="z must be \\(2, 24\\)"):
        gdn_mixer_decode(qkv, z[:, :20], a, b, conv, state, torch.tensor([1, 2]), weights, dims,
                         params)  # fmt: skip
