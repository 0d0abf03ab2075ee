"""kernels/cpu/moe.c, the routed experts in one C call, against a per-token float64 oracle and
the torch path (F.linear per expert), in float32 and bfloat16: expert-load edge cases, widths
that are not a multiple of the 64-column panels, gated (SwiGLU) and relu² experts, and the whole
MoE layer with group routing and the latent projection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.engine.layers.moe import MoE, MoEConfig
from baton.kernels.cpu import moe as cpu_moe
from baton.kernels.layouts import Routing
from baton.kernels.moe import fused_moe_torch
from tests.test_moe_kernels import experts_oracle, make_case

pytestmark = pytest.mark.skipif(
    cpu_moe.library() is None, reason="no C compiler: the CPU runs the per-expert GEMMs"
)

# (T, E, k, forced ids): an expert with no token and one with a full block plus a partial one;
# every token on one expert; a batch of one; prefill-sized (many row blocks per expert).
LOADS = {
    "idle_and_partial_blocks": (9, 7, 2, torch.tensor([[0, 2], [2, 5], [2, 0]] * 3)),
    "all_to_one": (11, 4, 1, torch.full((11, 1), 3)),
    "batch_of_one": (1, 8, 3, None),
    "prefill_sized": (70, 5, 2, None),
}


def run_c(x, w_up, w_down, routing: Routing, activation: str) -> torch.Tensor:
    panels = cpu_moe.pack_panels(w_up, w_down, activation == "swiglu")
    assert panels is not None
    return cpu_moe.routed_experts(x, routing.ids, routing.weights, panels)


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("load", list(LOADS))
def test_c_experts_match_oracle_and_torch_path(load, dtype, activation):
    T, E, k, ids = LOADS[load]
    # D = 23: odd (bf16 reads k in pairs) and under one panel; I = 70: over one panel, padded
    x, w_up, w_down, routing = make_case(T, 23, 70, E, k, activation, dtype=dtype, ids=ids)
    out = run_c(x, w_up, w_down, routing, activation)
    assert out.shape == (T, 23) and out.dtype == dtype
    bf16 = dtype == torch.bfloat16
    ref = experts_oracle(x, w_up, w_down, routing, activation, dtype if bf16 else None)
    torch_path = fused_moe_torch(x, w_up, w_down, routing, activation)  # unpacked F.linear
    # bf16: float32 sums in another order can land a rounding of h one bf16 step away, and the
    # output itself is rounded to bf16
    tol = 3e-2 if bf16 else 1e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), torch_path.float(), atol=tol, rtol=tol)
    assert (out.double() - ref).abs().max() < 0.02 * ref.abs().max()


def test_c_experts_read_strided_rows():
    """Rows that are a view into a wider tensor (a column slice) give the same result."""
    x, w_up, w_down, routing = make_case(6, 32, 64, 4, 2, "relu2")
    wide = torch.cat([x, torch.randn(6, 5)], dim=1)[:, :32]
    torch.testing.assert_close(
        run_c(wide, w_up, w_down, routing, "relu2"), run_c(x, w_up, w_down, routing, "relu2")
    )


def test_c_experts_reject_an_expert_id_out_of_range():
    x, w_up, w_down, routing = make_case(3, 16, 8, 4, 2, "relu2")
    ids = routing.ids.clone()
    ids[1, 0] = 4
    with pytest.raises(IndexError, match="token 1 chose an expert outside"):
        run_c(x, w_up, w_down, Routing(routing.weights, ids), "relu2")


def moe_config(**overrides) -> MoEConfig:
    base = MoEConfig(
        router="sigmoid_grouped",
        num_experts=8,
        top_k=3,
        intermediate_size=40,
        shared_intermediate_size=24,
        latent_size=None,
        activation="relu2",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        norm_topk_eps=1e-20,
        expert_bias=True,
        routed_scaling_factor=2.5,
        bias=False,
        shared_expert_gate=False,
    )
    return dataclasses.replace(base, **overrides)


@pytest.mark.parametrize(
    "config",
    [
        moe_config(n_group=4, topk_group=2),
        moe_config(latent_size=16, bias=True),
        moe_config(activation="swiglu", norm_topk_prob=False),
    ],
    ids=["group_routing", "latent", "gated"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_on_c_path_matches_torch_path(config, dtype):
    torch.manual_seed(0)
    layer = MoE(32, config)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    layer = layer.to(dtype)
    layer.gate.float()  # the router stays float32, as the loader keeps it
    x = torch.randn(13, 32).to(dtype)
    with torch.no_grad():
        torch_path = layer(x)
        layer.experts.pack_for_cpu()
        assert isinstance(layer.experts.packed, cpu_moe.PanelExperts)
        c_path = layer(x)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(c_path.float(), torch_path.float(), atol=tol, rtol=tol)
