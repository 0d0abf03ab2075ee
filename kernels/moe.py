"""Mixture-of-experts: the router and the routed experts (torch path; Triton in triton/moe.py).

Shapes (T tokens, D model width seen by the experts, I expert width, E experts, k per token):
  x:           (T, D)            model dtype
  w_up:        (E, I, D)         relu2 experts: up_proj
               (E, 2I, D)        swiglu experts: gate_up_proj, gate rows first
  w_down:      (E, D, I)
  topk_ids:    (T, k) int64      chosen experts per token
  topk_weights:(T, k) float32    their weights
  returns      (T, D)            model dtype; sum over k of weight * expert(x), summed in float32
  lora:        the routed experts' adapters of this forward (kernels/lora.py's ExpertDeltas) or
               None: each pair's up projection gets its token's slot's B_e A_e x before the
               activation, its down projection B_e A_e h (rows without an adapter: nothing)

On the CPU, experts packed by `pack_experts` run in one C call (kernels/cpu/moe.py: grouping,
experts and combine, no host sync). Otherwise the torch path sorts the (token, choice) pairs by
expert and runs one matmul pair per expert that received tokens: no per-token Python loop and
no dense all-experts compute. Its per-expert counts come back to the host (a sync), which is
fine on the CPU; the Triton path (kernels/triton/moe.py) keeps them on the device so a CUDA
graph can capture it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import moe as cpu_moe
from baton.kernels.cpu.moe import PanelExperts, QuantPanelExperts
from baton.kernels.layouts import Activation, Routing
from baton.kernels.linear import can_pack
from baton.kernels.lora import ExpertDeltas
from baton.kernels.quant import QuantizedTensor, dequantize

# An expert stack: a plain (E, out, in) tensor or its quantized form (kernels/quant.py)
ExpertWeights = torch.Tensor | QuantizedTensor


def route_sigmoid_grouped(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    norm_eps: float = 1e-20,
) -> Routing:
    """NemotronH's (DeepSeek-V3-style) router, in float32 whatever x's dtype: bf16 logits flip
    near-equal top-k choices, so transformers keeps the gate and the bias in float32 too.
    LFM2-MoE's is the same with one group (its `expert_bias`, its norm_eps 1e-6).

    x: (T, hidden); gate_weight: (E, hidden) float32; correction_bias: (E,) float32.
    The bias only steers the choice; the weights are the unbiased sigmoid scores, renormalised
    as w / (sum + norm_eps) when norm_topk_prob."""
    E = gate_weight.shape[0]
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    choice = scores + correction_bias.float()
    if n_group > 1:
        # A group's score is the sum of its two best experts; keep the best topk_group groups.
        group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        # each group's flag over its experts (a broadcast: repeat_interleave with a Python
        # count is a data-shaped op to a captured step's recorder)
        expert_mask = group_mask[:, :, None].expand(-1, n_group, E // n_group).reshape(-1, E)
        expert_mask = expert_mask.bool()
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + norm_eps)
    return Routing(weights * scaling, ids)


def route_softmax_topk(x: torch.Tensor, weight: torch.Tensor, *, top_k: int) -> Routing:
    """Mixtral-style router (Granite-4.0-H): the top-k of the logits, softmax over those k.

    x: (T, hidden); weight: (E, hidden), both in the model dtype as transformers keeps them
    (the logits are upcast after the matmul, the weights rounded back to x's dtype)."""
    logits = F.linear(x, weight).float()
    top, ids = logits.topk(top_k, dim=-1)
    return Routing(torch.softmax(top, dim=-1).to(x.dtype).float(), ids)


def route_softmax_all_topk(
    x: torch.Tensor, weight: torch.Tensor, *, top_k: int, norm_topk_prob: bool
) -> Routing:
    """Qwen's router (Qwen2-MoE to Qwen3.5): softmax over every expert's logit in float32, the
    top-k probabilities, renormalised to sum 1 when `norm_topk_prob`, rounded to the logits'
    dtype (the model's), as transformers computes them.

    x: (T, hidden); weight: (E, hidden), both in the model dtype."""
    logits = F.linear(x, weight)
    top, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(top.to(logits.dtype).float(), ids)


def route_topk_of_softmax(x: torch.Tensor, weight: torch.Tensor, *, top_k: int) -> Routing:
    """Jamba's router: a softmax over every expert's logit, then the top-k probabilities as they
    are (they do not sum to one). x: (T, hidden); weight: (E, hidden); float32 math."""
    probs = torch.softmax(F.linear(x.float(), weight.float()), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return Routing(weights, ids)


class PackedExperts(NamedTuple):
    """Per-expert weights reordered once into oneDNN's blocked layout (kernels/linear.py), where
    the C path (kernels/cpu/moe.py) is not built: the few-row matmuls of decode then skip
    F.linear's per-call repacking."""

    up: list[torch.Tensor]
    down: list[torch.Tensor]


def pack_experts(
    w_up: ExpertWeights, w_down: ExpertWeights, activation: Activation
) -> PanelExperts | QuantPanelExperts | PackedExperts | None:
    """The C path's panels (kernels/cpu/moe.py) where it takes these weights, else oneDNN's
    layouts; None where neither can run the dtype or the weights are not on the CPU (quantized
    weights without the C path: the torch path dequantizes an expert when it runs)."""
    if isinstance(w_up, QuantizedTensor):
        return cpu_moe.pack_quantized(w_up, w_down, activation == "swiglu")
    panels = cpu_moe.pack_panels(w_up, w_down, activation == "swiglu")
    return panels if panels is not None else pack_onednn(w_up, w_down)


def pack_onednn(w_up: torch.Tensor, w_down: torch.Tensor) -> PackedExperts | None:
    """None where oneDNN cannot run the dtype or the weights are not on the CPU."""
    if w_up.device.type != "cpu" or not can_pack(w_up.dtype):
        return None
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return PackedExperts(
        up=[reorder(w_up[e].contiguous(), None) for e in range(w_up.shape[0])],
        down=[reorder(w_down[e].contiguous(), None) for e in range(w_down.shape[0])],
    )


def fused_moe(
    x: torch.Tensor,
    w_up: ExpertWeights,
    w_down: ExpertWeights,
    routing: Routing,
    activation: Activation,
    packed: PanelExperts | QuantPanelExperts | PackedExperts | None = None,
    lora: ExpertDeltas | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]); dispatches on device like every kernel."""
    _check(x, w_up, w_down, routing, activation)
    if select_backend(x) == "triton":
        from baton.kernels.triton.moe import fused_moe_triton

        return fused_moe_triton(x, w_up, w_down, routing, activation, lora)
    return fused_moe_torch(x, w_up, w_down, routing, activation, packed, lora)


def fused_moe_torch(
    x: torch.Tensor,
    w_up: ExpertWeights,
    w_down: ExpertWeights,
    routing: Routing,
    activation: Activation,
    packed: PanelExperts | QuantPanelExperts | PackedExperts | None = None,
    lora: ExpertDeltas | None = None,
) -> torch.Tensor:
    T, k = routing.ids.shape
    E = w_up.shape[0]
    if T == 0:
        return x.new_zeros(0, x.shape[1])
    if isinstance(packed, (PanelExperts, QuantPanelExperts)) and cpu_moe.supported(x, k, lora):
        return cpu_moe.routed_experts(x, routing.ids, routing.weights, packed, lora)
    flat_ids = routing.ids.flatten()
    # Stable sort: within an expert, pairs keep token order, as transformers' loop does.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    token_of = order // k
    rows = x[token_of]
    if isinstance(packed, (PanelExperts, QuantPanelExperts)):
        packed = None  # panels the C call cannot take (more choices per token than it sorts)
    if lora is not None:
        pair_slots = lora.pair_slots(routing.ids)
        up_delta = lora.up_delta(x, pair_slots, k)
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        adapter = None if lora is None else _RowsAdapter(lora, up_delta[pairs], pair_slots[pairs])
        outs.append(_expert(rows[start : start + n], e, w_up, w_down, activation, packed, adapter))
        start += n
    ys = torch.cat(outs) if len(outs) > 1 else outs[0]
    return _combine(ys, routing, order, token_of, T, x.dtype)


def _combine(ys, routing: Routing, order, token_of, T: int, dtype: torch.dtype) -> torch.Tensor:
    """Weighted and summed in float32, like transformers (its routing weights are float32)."""
    ys = ys.float() * routing.weights.flatten()[order].unsqueeze(1)
    out = torch.zeros(T, ys.shape[1], dtype=torch.float32, device=ys.device)
    out.index_add_(0, token_of, ys)
    return out.to(dtype)


class _RowsAdapter(NamedTuple):
    """One expert's rows' adapters in the torch path."""

    deltas: ExpertDeltas
    up_delta: torch.Tensor  # (n, up_rows) float32, the rows' pairs' up deltas
    pair_slots: torch.Tensor  # (n,) int64, the rows' pairs' row groups (ExpertDeltas)


def _expert(rows, e, w_up, w_down, activation: Activation, packed: PackedExperts | None, adapter):
    """One expert on its rows: (n, D) -> (n, D); adapter: a _RowsAdapter or None."""
    h = _project(rows, None if packed is None else packed.up[e], w_up, e)
    if adapter is not None:
        h = (h.float() + adapter.up_delta).to(h.dtype)
    if activation == "relu2":
        h = torch.relu(h).square()
    else:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    y = _project(h, None if packed is None else packed.down[e], w_down, e)
    if adapter is not None:
        adapter.deltas.down_delta(h, adapter.pair_slots, y)
    return y


def _project(rows: torch.Tensor, packed: torch.Tensor | None, w: ExpertWeights, e: int):
    """rows @ expert e's matrix of w: oneDNN's packed copy where there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    return F.linear(rows, _matrix(w, e, rows.dtype))


def _matrix(w: ExpertWeights, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's (out, in) matrix; a quantized one dequantized for this call only."""
    return dequantize(w.rows(e), dtype) if isinstance(w, QuantizedTensor) else w[e]


def _check(x, w_up, w_down, routing: Routing, activation: Activation) -> None:
    T, D = x.shape
    E, up_rows, D_up = w_up.shape
    width = up_rows // 2 if activation == "swiglu" else up_rows
    if activation not in ("relu2", "swiglu"):
        raise ValueError(f"unsupported expert activation {activation!r}")
    if D_up != D or tuple(w_down.shape) != (E, D, width):
        raise ValueError(
            f"expert weights {tuple(w_up.shape)} / {tuple(w_down.shape)} do not fit x {tuple(x.shape)}"
            f" with {activation} experts"
        )
    if routing.ids.shape != routing.weights.shape or routing.ids.shape[0] != T:
        raise ValueError(
            f"routing ids {tuple(routing.ids.shape)} / weights {tuple(routing.weights.shape)} "
            f"do not fit {T} tokens"
        )
