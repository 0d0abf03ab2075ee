"""The MoE block: float32 router, routed experts, one shared expert, optional latent projection.

Parameter names follow transformers' NemotronH (`gate.weight`, `gate.e_score_correction_bias`,
`experts.up_proj` / `experts.down_proj` stacked (E, out, in), `shared_experts.*`,
`fc1_latent_proj` / `fc2_latent_proj`); the loader stacks a checkpoint's per-expert tensors
(`experts.{e}.up_proj.weight`) into the stacked parameters, and SwiGLU experts stored as
separate `gate_proj` / `up_proj` per expert (Jamba, LFM2-MoE) into the [gate | up] rows of one.

    x ──> gate (float32) ──> (weights, ids)
    x ──> [fc1_latent_proj] ──> experts (fused_moe) ──> [fc2_latent_proj] ──┐
    x ──> shared_experts (when there is one) ───────────────────────────────+──> out
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.checkpoint.weights import ExpertParts, expert_parts
from baton.engine.layers.mlp import GatedMLP, ReluSquaredMLP
from baton.engine.quantization.modules import stacked_weight
from baton.kernels.cpu.moe import PanelExperts
from baton.kernels.moe import (
    PackedExperts,
    Routing,
    fused_moe,
    pack_experts,
    route_sigmoid_grouped,
    route_softmax_all_topk,
    route_softmax_topk,
    route_topk_of_softmax,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """A routed mixture of experts plus one always-on shared expert (NemotronH's `moe` block;
    Qwen3-Next's and Qwen3.5's sparse MoE block).

    Router "softmax_topk" (Granite-4.0-H, Qwen): the top-k of a softmax over every expert,
    renormalised when `norm_topk_prob` (then the softmax over the top-k logits); the grouping
    fields are then 1 and no correction bias exists.
    Router "topk_of_softmax" (Jamba): softmax over every logit, the top-k probabilities as they
    are (not renormalised); grouping fields 1, no bias.
    Router "sigmoid_grouped" (NemotronH, LFM2-MoE with one group): sigmoid scores of a float32
    linear; top-k choice on scores + the expert bias (`expert_bias`: NemotronH's
    `e_score_correction_bias`, LFM2-MoE's `expert_bias`) restricted to the best `topk_group` of
    `n_group` expert groups (a group's score is the sum of its two best experts); weights are
    the chosen sigmoid scores, divided by (their sum + `norm_topk_eps`) when `norm_topk_prob`,
    times `routed_scaling_factor`.
    """

    router: Literal["sigmoid_grouped", "softmax_topk", "topk_of_softmax"]
    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    # the shared expert (an MLP beside the routed ones); None: there is none (Jamba, LFM2-MoE)
    shared_intermediate_size: int | None
    # Experts run in a smaller space: fc1_latent_proj (hidden -> latent) before them and
    # fc2_latent_proj (latent -> hidden) after (Nemotron 3 Super). None: no projection.
    latent_size: int | None
    activation: Literal["relu2", "swiglu"]  # relu2: up/down experts; swiglu: gate_up/down
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    norm_topk_eps: float  # NemotronH's 1e-20, LFM2-MoE's 1e-6
    expert_bias: bool  # sigmoid router: a bias steers the top-k choice
    routed_scaling_factor: float
    bias: bool  # bias of the shared expert and latent projections (`mlp_bias`)
    # Qwen3-Next / Qwen3.5: the shared expert's output is scaled by sigmoid(shared_expert_gate(x)),
    # a (1, hidden) linear. The shared expert's activation is the routed experts' (relu2 up/down,
    # or SwiGLU gate/up/down).
    shared_expert_gate: bool


class Router(nn.Module):
    """Kept in float32 whatever the model dtype (the loader skips modules with
    `keep_float32`), as transformers keeps NemotronH's `gate.weight` and correction bias."""

    keep_float32 = True

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.expert_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        c = self.config
        if c.router == "topk_of_softmax":
            return route_topk_of_softmax(x, self.weight, top_k=c.top_k)
        bias = self.e_score_correction_bias
        return route_sigmoid_grouped(
            x,
            self.weight,
            bias if bias is not None else torch.zeros_like(self.weight[:, 0]),
            top_k=c.top_k,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            scaling=c.routed_scaling_factor,
            norm_eps=c.norm_topk_eps,
        )


class SoftmaxRouter(nn.Module):
    """Qwen's `gate.weight` (E, hidden), in the model dtype as transformers keeps it."""

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> Routing:
        c = self.config
        return route_softmax_all_topk(
            x, self.weight, top_k=c.top_k, norm_topk_prob=c.norm_topk_prob
        )


class Experts(nn.Module):
    """Under tensor parallelism every rank holds every expert, with a slice of its
    intermediate (vLLM's default, not expert parallelism): all ranks do equal work whatever
    the routing picks, and the partial outputs join the MoE's one all-reduce."""

    # (E, out, in) weights a quantized checkpoint may store quantized (engine/quantization)
    quantizable_stacks = ("up_proj", "down_proj")

    def __init__(self, width: int, config: MoEConfig):
        super().__init__()
        tp = parallel.current()
        first, inter = parallel.split_evenly(config.intermediate_size, tp, "moe_intermediate_size")
        E, full = config.num_experts, config.intermediate_size
        up_rows = 2 * inter if config.activation == "swiglu" else inter
        self.activation = config.activation
        self.top_k = config.top_k  # experts each token runs (what a step reads of them)
        self.up_proj = nn.Parameter(torch.zeros(E, up_rows, width))
        self.down_proj = nn.Parameter(torch.zeros(E, width, inter))
        mine = parallel.Slices(dim=-2, ranges=((first, inter),)) if tp.size > 1 else None
        if config.activation == "swiglu":  # checkpoints that keep gate and up apart per expert
            expert_parts(self.up_proj, ExpertParts(names=("gate_proj", "up_proj"), rule=mine))
        if tp.size > 1:
            # Rules on the last two dims: they fit one expert's (out, in) checkpoint tensor and
            # the stacked (E, out, in) alike.
            up = ((first, inter), (full + first, inter)) if up_rows > inter else ((first, inter),)
            parallel.shard(self.up_proj, parallel.Slices(dim=-2, ranges=up))
            parallel.shard(self.down_proj, parallel.Slices(dim=-1, ranges=((first, inter),)))
        self.packed: PanelExperts | PackedExperts | None = None  # CPU: C panels or oneDNN
        # LoRA on the experts (engine/lora/experts.py's ExpertAdapters, set when adapters are
        # enabled): its `deltas()` are this forward's per-expert deltas, or None
        self.adapters: nn.Module | None = None

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        up, down = stacked_weight(self.up_proj), stacked_weight(self.down_proj)
        lora = self.adapters.deltas() if self.adapters is not None else None
        return fused_moe(x, up, down, routing, self.activation, self.packed, lora)

    def pack_for_cpu(self) -> None:
        """Pack each expert's weights once for the C path (or oneDNN); the stacked copies stay
        (the Triton path and BATON_KERNELS=triton in the interpreter read them)."""
        up, down = stacked_weight(self.up_proj), stacked_weight(self.down_proj)
        self.packed = pack_experts(up, down, self.activation)


class MoE(nn.Module):
    def __init__(self, hidden_size: int, config: MoEConfig, shared_name: str = "shared_experts"):
        """shared_name: the shared expert's module name in checkpoints (NemotronH's
        `shared_experts`, Qwen's `shared_expert`)."""
        super().__init__()
        router = SoftmaxRouter if config.router == "softmax_topk" else Router
        self.gate = router(hidden_size, config)
        latent = config.latent_size
        self.experts = Experts(latent if latent is not None else hidden_size, config)
        self.tp = tp = parallel.current()
        self.shared_name = shared_name
        shared: nn.Module | None = None
        if config.shared_intermediate_size is not None and config.activation == "swiglu":
            shared = GatedMLP(
                hidden_size,
                config.shared_intermediate_size,
                config.bias,
                "silu",
                reduce_output=False,
                what="shared_expert_intermediate_size",
            )
        elif config.shared_intermediate_size is not None:
            shared = ReluSquaredMLP(
                hidden_size,
                config.shared_intermediate_size,
                config.bias,
                reduce_output=False,
                what="moe_shared_expert_intermediate_size",
            )
        self.add_module(shared_name, shared)
        # Replicated (one output column): every rank scales its partial shared output alike.
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False) if config.shared_expert_gate else None
        )
        self.fc1_latent_proj: nn.Module | None = None
        self.fc2_latent_proj: nn.Module | None = None
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent, bias=config.bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden_size, bias=config.bias)
            # Replicated, but fed partial expert sums: linear, so its outputs add up across
            # ranks once rank 0 alone adds the bias.
            parallel.shard(self.fc2_latent_proj.bias, parallel.FirstRankOnly(rank=tp.rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.gate(x)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts(routed, routing)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        shared = getattr(self, self.shared_name)
        if shared is not None:
            out = shared(x)
            if self.shared_expert_gate is not None:
                out = torch.sigmoid(self.shared_expert_gate(x)) * out
            routed = routed + out
        return self.tp.all_reduce(routed)


class StackedWeight(nn.Module):
    """A module holding one `weight` (checkpoint names like `router.layer.weight`)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class SoftmaxTopKMoE(nn.Module):
    """Mixtral-style routed SwiGLU experts, no shared expert inside (Granite-4.0-H's
    `block_sparse_moe`): `router.layer.weight` (E, hidden), experts stacked as
    `input_linear.weight` (E, 2I, hidden, gate rows first) and `output_linear.weight`
    (E, hidden, I), as transformers' save_pretrained writes them."""

    quantizable_stacks = ("input_linear", "output_linear")  # (engine/quantization)

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        E, inter = config.num_experts, config.intermediate_size
        self.top_k = config.top_k
        self.router = nn.Module()
        self.router.layer = StackedWeight(E, hidden_size)
        self.input_linear = StackedWeight(E, 2 * inter, hidden_size)
        self.output_linear = StackedWeight(E, hidden_size, inter)
        self.packed: PanelExperts | PackedExperts | None = None  # CPU: C panels or oneDNN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route_softmax_topk(x, self.router.layer.weight, top_k=self.top_k)
        w_up, w_down = stacked_weight(self.input_linear), stacked_weight(self.output_linear)
        return fused_moe(x, w_up, w_down, routing, "swiglu", self.packed)

    def pack_for_cpu(self) -> None:
        w_up, w_down = stacked_weight(self.input_linear), stacked_weight(self.output_linear)
        self.packed = pack_experts(w_up, w_down, "swiglu")
