"""The MoE router and experts: torch path vs a per-token oracle and transformers' router, the
expert-load edge cases, and the Triton fused kernel vs the torch path in the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.kernels.layouts import Routing
from baton.kernels.moe import fused_moe_torch, pack_experts, pack_onednn, route_sigmoid_grouped
from baton.kernels.triton.moe import fused_moe_triton


def experts_oracle(x, w_up, w_down, routing: Routing, activation: str, round_to=None):
    """Token by token, choice by choice, in float64; `round_to`: the dtype a low-precision model
    rounds the up projection and the activation to."""
    r = (lambda v: v.to(round_to).double()) if round_to is not None else (lambda v: v)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(routing.ids.shape[1]):
            e = int(routing.ids[t, j])
            h = r(w_up[e].double() @ x[t].double())
            if activation == "relu2":
                h = torch.relu(h) ** 2
            else:
                gate, up = h.chunk(2)
                h = r(F.silu(gate)) * up
            out[t] += float(routing.weights[t, j]) * (w_down[e].double() @ r(h))
    return out


def make_case(T, D, inter, E, k, activation, dtype=torch.float32, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if activation == "swiglu" else inter
    x = torch.randn(T, D, generator=g).to(dtype)
    w_up = (torch.randn(E, rows, D, generator=g) / D**0.5).to(dtype)
    w_down = (torch.randn(E, D, inter, generator=g) / inter**0.5).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    return x, w_up, w_down, Routing(weights, ids.long())


# (T, E, k, forced ids): spread load; an expert that gets no token; every token on one expert
# (k=1); a batch of one; no tokens at all.
LOADS = {
    "spread": (9, 6, 2, None),
    "idle_experts": (5, 8, 2, torch.tensor([[0, 3]] * 5)),
    "all_to_one": (7, 4, 1, torch.full((7, 1), 2)),
    "batch_of_one": (1, 8, 3, None),
    "empty": (0, 4, 2, torch.zeros(0, 2, dtype=torch.long)),
    # prefill-sized: many row blocks per expert
    "prefill_sized": (40, 4, 2, None),
}


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("load", list(LOADS))
def test_torch_experts_match_per_token_oracle(load, activation):
    T, E, k, ids = LOADS[load]
    x, w_up, w_down, routing = make_case(T, 16, 12, E, k, activation, ids=ids)
    ref = experts_oracle(x, w_up, w_down, routing, activation)
    out = fused_moe_torch(x, w_up, w_down, routing, activation)
    assert out.shape == (T, 16) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # the C path's panels (kernels/cpu/moe.py) and oneDNN's prepacked weights compute the same
    for packed in (pack_experts(w_up, w_down, activation), pack_onednn(w_up, w_down)):
        if packed is not None:
            out_packed = fused_moe_torch(x, w_up, w_down, routing, activation, packed)
            torch.testing.assert_close(out_packed.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
def test_router_matches_transformers(grouped):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    kwargs = dict(n_group=4, topk_group=2, norm_topk_prob=False) if grouped else {}
    config = NemotronHConfig(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        routed_scaling_factor=2.5,
        **kwargs,
    )
    router = NemotronHTopkRouter(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
    x = torch.randn(40, 32, generator=g).to(torch.bfloat16)  # a bf16 model's hidden state
    _, ref_weights, ref_ids = router(x)
    ours = route_sigmoid_grouped(
        x,
        router.weight,
        router.e_score_correction_bias,
        top_k=3,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        scaling=2.5,
    )
    assert ours.weights.dtype == torch.float32
    ref_sorted, order = ref_ids.sort(dim=-1)
    ours_sorted, ours_order = ours.ids.sort(dim=-1)
    assert torch.equal(ours_sorted, ref_sorted)
    torch.testing.assert_close(
        ours.weights.gather(1, ours_order), ref_weights.gather(1, order), atol=1e-6, rtol=1e-6
    )
    if grouped:  # every choice lies in at most topk_group=2 of the 4 groups
        assert all(len(set((row // 4).tolist())) <= 2 for row in ours.ids)


def test_group_limit_changes_the_choice():
    """With group routing, an expert outside the best groups loses to weaker ones inside."""
    gate = torch.zeros(8, 4)
    bias = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.5, 0.5, 0.0, 0.0])  # groups of 2: (0,1) (2,3)...
    x = torch.zeros(1, 4)
    free = route_sigmoid_grouped(
        x, gate, bias, top_k=2, n_group=1, topk_group=1, norm_topk_prob=True, scaling=1.0
    )
    grouped = route_sigmoid_grouped(
        x, gate, bias, top_k=2, n_group=4, topk_group=1, norm_topk_prob=True, scaling=1.0
    )
    assert sorted(free.ids[0].tolist())[0] == 2  # the single best expert is chosen freely
    assert sorted(grouped.ids[0].tolist()) == [4, 5]  # group (4,5) sums higher than (2,3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("load", ["spread", "idle_experts", "all_to_one", "batch_of_one"])
def test_triton_fused_moe_matches_torch_path(load, activation, dtype):
    T, E, k, ids = LOADS[load]
    x, w_up, w_down, routing = make_case(T, 16, 16, E, k, activation, dtype=dtype, ids=ids)
    ref = fused_moe_torch(x.float(), w_up.float(), w_down.float(), routing, activation)
    out = fused_moe_triton(x, w_up, w_down, routing, activation)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_triton_fused_moe_on_empty_batch():
    T, E, k, ids = LOADS["empty"]
    x, w_up, w_down, routing = make_case(T, 16, 16, E, k, "relu2", ids=ids)
    assert fused_moe_triton(x, w_up, w_down, routing, "relu2").shape == (0, 16)


def test_moe_engine_on_triton_kernels_matches_torch_engine(tiny_models, monkeypatch):
    """BATON_KERNELS picks the fused MoE kernel like every other kernel (interpreter here)."""
    import baton.kernels.triton.moe
    from baton import LLM, SamplingParams

    calls = []
    original = baton.kernels.triton.moe.fused_moe_triton
    monkeypatch.setattr(
        baton.kernels.triton.moe,
        "fused_moe_triton",
        lambda *a, **kw: (calls.append(a[0].shape[0]), original(*a, **kw))[1],
    )
    model_dir, _ = tiny_models("moe_latent")
    prompts = [[5], list(range(3, 14))]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(page_size=16, chunked_prefill_size=16, enable_prefix_caching=False)
    monkeypatch.setenv("BATON_KERNELS", "torch")
    reference = LLM(model_dir, **args).generate(prompts, params)
    assert not calls
    monkeypatch.setenv("BATON_KERNELS", "triton")
    outs = LLM(model_dir, **args).generate(prompts, params)
    assert calls  # the fused kernel really ran, for prefill and decode rows
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs, ref.logprobs):
            for token, lp in theirs.items():
                assert abs(mine[token] - lp) < 1e-3
