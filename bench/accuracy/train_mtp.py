"""Teach the shipped model a multi-token-prediction (MTP) layer, the model itself frozen.

    python -m baton.bench.accuracy.train_mtp --model assets [--minutes 20] [--threads 1]

The layer is Nemotron 3 Super's kind (config `num_nextn_predict_layers: 1`,
`mtp_layers_block_type: ["full_attention", "moe"]`): at position p it fuses the embedding of
token p + 1 with the model's final hidden state at p (enorm, hnorm, eh_proj), runs an attention
block over its own keys and values and a MoE block (sigmoid router, top-2 of 8 relu² experts
plus a shared one), normalises (final_layernorm), and the model's own lm_head predicts token
p + 2. It learns on the trainer's data (bench/accuracy/train_demo.py: 5-shot GSM8K-format sequences, loss
on the answers), from the frozen model's hidden states; the model's weights, and so its answers,
do not change. The weights are added to the directory's model.safetensors under the names
published checkpoints use (`mtp.layers.{j}....`, one tensor per expert) and config.json gains the
MTP keys; `--speculative-config '{"method": "mtp", ...}'` then drafts with it. Held-out prompts
decoded with speculation report the mean acceptance length at k = 1..4 at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from baton.bench.accuracy.gsm8k import build_prompts
from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH, generate, read_jsonl
from baton.bench.accuracy.train_demo import NUM_SHOTS, lr_at, make_batch

# The MoE of the MTP layer; the model's own stack has no MoE layer, so these keys of its
# config.json describe nothing else.
MTP_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=192,
    moe_shared_expert_intermediate_size=192,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
)
MTP_BLOCKS = ["full_attention", "moe"]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    """Causal GQA attention without positions (NemotronH's NoPE), q/k/v/o as checkpoints."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MoE(nn.Module):
    """NemotronH's MoE: sigmoid scores, top-k (no correction bias learnt: it is a balancing
    buffer), weights renormalised, relu² experts over their tokens; plus the shared expert."""

    def __init__(self, hidden: int, experts: int, top_k: int, inter: int, shared: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.randn(experts, hidden) * hidden**-0.5)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.up = nn.Parameter(torch.randn(experts, inter, hidden) * hidden**-0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, inter) * inter**-0.5 * 0.5)
        self.shared_experts = nn.Module()
        self.shared_experts.up_proj = nn.Linear(hidden, shared, bias=False)
        self.shared_experts.down_proj = nn.Linear(shared, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(flat @ self.gate.weight.T)
        choice = (scores + self.gate.e_score_correction_bias).topk(self.top_k, -1).indices
        weights = scores.gather(-1, choice)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = torch.zeros_like(flat)
        for e in range(self.up.shape[0]):  # each expert over the tokens routed to it
            rows, slot = (choice == e).nonzero(as_tuple=True)
            if rows.numel():
                h = F.relu(flat[rows] @ self.up[e].T).pow(2) @ self.down[e].T
                routed = routed.index_add(0, rows, h * weights[rows, slot, None])
        shared = self.shared_experts.down_proj(F.relu(self.shared_experts.up_proj(flat)).pow(2))
        return (routed + shared).view_as(x)

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {
            f"{prefix}.gate.weight": self.gate.weight,
            f"{prefix}.gate.e_score_correction_bias": self.gate.e_score_correction_bias,
            f"{prefix}.shared_experts.up_proj.weight": self.shared_experts.up_proj.weight,
            f"{prefix}.shared_experts.down_proj.weight": self.shared_experts.down_proj.weight,
        }
        for e in range(self.up.shape[0]):
            out[f"{prefix}.experts.{e}.up_proj.weight"] = self.up[e]
            out[f"{prefix}.experts.{e}.down_proj.weight"] = self.down[e]
        return out


class MTPLayer(nn.Module):
    """mtp.layers.0: fusion + attention block; mtp.layers.1: MoE block + final norm."""

    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm0, self.norm1 = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.attention = Attention(
            hidden, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        self.moe = MoE(
            hidden,
            MTP_MOE["n_routed_experts"],
            MTP_MOE["num_experts_per_tok"],
            MTP_MOE["moe_intermediate_size"],
            MTP_MOE["moe_shared_expert_intermediate_size"],
        )
        self.final_layernorm = RMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = x + self.attention(self.norm0(x))
        x = x + self.moe(self.norm1(x))
        return self.final_layernorm(x)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "mtp.layers.0.enorm.weight": self.enorm.weight,
            "mtp.layers.0.hnorm.weight": self.hnorm.weight,
            "mtp.layers.0.eh_proj.weight": self.eh_proj.weight,
            "mtp.layers.0.norm.weight": self.norm0.weight,
            "mtp.layers.1.norm.weight": self.norm1.weight,
            "mtp.layers.1.final_layernorm.weight": self.final_layernorm.weight,
        }
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"mtp.layers.0.mixer.{proj}.weight"] = getattr(self.attention, proj).weight
        out.update(self.moe.checkpoint_tensors("mtp.layers.1.mixer"))
        return {name: t.detach().float().contiguous() for name, t in out.items()}


def mtp_loss(model, head: MTPLayer, input_ids: torch.Tensor, loss_mask: torch.Tensor):
    """Position p (embedding of token p + 1, frozen hidden state at p) predicts token p + 2,
    learnt where that token belongs to an answer."""
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # after the final norm: what the engine hands the layer
        embeds = model.get_input_embeddings()(input_ids)
    x = head(embeds[:, 1:-1], hidden[:, :-2])
    logits = model.lm_head(x)
    targets = input_ids[:, 2:]
    mask = loss_mask[:, 1:-1]
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return (losses * mask.reshape(-1)).sum() / mask.sum()


def save_mtp(directory: Path, head: MTPLayer) -> None:
    from safetensors.torch import load_file, save_file

    config_path = directory / "config.json"
    raw = json.loads(config_path.read_text())
    raw.update(MTP_MOE, num_nextn_predict_layers=1, mtp_layers_block_type=MTP_BLOCKS)
    config_path.write_text(json.dumps(raw, indent=2) + "\n")
    weights_path = directory / "model.safetensors"
    weights = {n: t for n, t in load_file(str(weights_path)).items() if not n.startswith("mtp.")}
    save_file(weights | head.checkpoint_tensors(), str(weights_path), metadata={"format": "pt"})


def acceptance(model_dir: Path, prompts: list[str], ks: tuple[int, ...]) -> dict[int, float]:
    """Mean acceptance length (tokens per verify row) of greedy held-out answers at each k."""
    from baton import LLM, SamplingParams
    from baton.bench.accuracy.gsm8k import STOP

    out = {}
    for k in ks:
        llm = LLM(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": k})
        llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0, stop=STOP))
        stats = llm.stats()
        out[k] = round(
            1 + stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_drafts), 3
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.accuracy.train_mtp", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--model", default="assets", help="model directory (the MTP layer is added to it)")
    add("--steps", type=int, default=1500, help="optimizer steps at most; the cosine ends here")
    add("--minutes", type=float, default=20.0, help="stop after this much training time")
    add("--batch-size", type=int, default=8)
    add("--lr", type=float, default=2e-3)
    add("--warmup-steps", type=int, default=50)
    add("--seed", type=int, default=1)
    add("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    add("--eval-questions", type=int, default=40, help="held-out prompts for the acceptance")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, NemotronHForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directory = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = NemotronHForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    model.requires_grad_(False)
    torch.manual_seed(args.seed)
    head = MTPLayer(model.config)
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01
    )
    stream = generate(args.seed + 7, "train")  # problems the model's own training did not draw
    train_s, step, smoothed = 0.0, 0, None
    while step < args.steps and train_s < args.minutes * 60:
        started = time.monotonic()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup_steps)
        batch = make_batch(tokenizer, stream, args.batch_size)
        loss = mtp_loss(model, head, batch.input_ids, batch.loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        train_s += time.monotonic() - started
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % 50 == 0:
            print(f"step {step}  {train_s / 60:5.1f} min  loss {smoothed:.4f}", flush=True)
    save_mtp(directory, head)
    prompts = build_prompts(read_jsonl(HELDOUT_PATH), NUM_SHOTS, args.eval_questions)
    summary = {
        "steps": step,
        "train_minutes": round(train_s / 60, 2),
        "final_loss": round(smoothed or math.nan, 4),
        "mean_acceptance_length": acceptance(directory, prompts, (1, 2, 3, 4)),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
