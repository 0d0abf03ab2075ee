"""Read PEFT's adapters on routed MoE experts (`target_parameters`) onto engine/lora/experts.py.

What PEFT 0.21 writes, with transformers 5's fused expert parameters (E experts, r the rank of
that parameter): one `ParamWrapper` per targeted parameter, nested when a module holds several
(the parameter registered first innermost: `gate_up_proj` / `up_proj` before `down_proj`):

    <module>.experts.base_layer.lora_A.weight   (r E, in)    the inner wrapper: the up projection
    <module>.experts.base_layer.lora_B.weight   (out, r E)
    <module>.experts.lora_A.weight              (r E, in)    the outer one: down_proj
    <module>.experts.lora_B.weight              (out, r E)

For a parameter (E, out, in) PEFT swaps its in/out (`is_transposed` False), and expert e's
delta is B_e A_e * scaling with A_e = A.reshape(E, r, in)[e] and B_e = B.reshape(out, r, E)[:, :, e]
(`ParamWrapper.get_delta_weight`). The model types PEFT converts from transformers 4's
per-expert modules (Qwen2-MoE's pattern, which Qwen3-Next takes; not Jamba, NemotronH, Qwen3.5-MoE:
there target_parameters are written by hand) get their `target_modules`
gate_proj / up_proj / down_proj turned into target_parameters gate_up_proj / down_proj, with
`rank_pattern` / `alpha_pattern` {'.*\\.gate_up_proj': 2 r / 2 alpha}: the fused projection's
rank is twice the adapter's. Those patterns are read with PEFT's matching (`get_pattern_key`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from baton.engine.lora.experts import STACKED_NAMES, ExpertLoRA
from baton.engine.parallel import Slices

BASE_LAYER = ".base_layer"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertConfig:
    """The config's fields expert adapters read (checked by engine/lora/adapter.py)."""

    r: int
    alpha: float
    rslora: bool
    target_parameters: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    @classmethod
    def of(cls, config: dict, r: int, alpha: float) -> ExpertConfig:
        return cls(
            r=r,
            alpha=alpha,
            rslora=bool(config.get("use_rslora")),
            target_parameters=tuple(config.get("target_parameters") or ()),
            rank_pattern=dict(config.get("rank_pattern") or {}),
            alpha_pattern=dict(config.get("alpha_pattern") or {}),
        )

    def pattern(self, patterns: dict, key: str) -> str | None:
        """PEFT's get_pattern_key: the first pattern matching a suffix of `key` at a dot."""
        return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)

    def rank_and_scaling(self, key: str) -> tuple[int, float]:
        rank_key, alpha_key = (self.pattern(self.rank_pattern, key),
                               self.pattern(self.alpha_pattern, key))  # fmt: skip
        r = self.rank_pattern[rank_key] if rank_key is not None else self.r
        alpha = self.alpha_pattern[alpha_key] if alpha_key is not None else self.alpha
        return r, alpha / math.sqrt(r) if self.rslora else alpha / r


def container(module: str) -> tuple[str, int]:
    """(the module PEFT wrapped, how deep this wrapper sits: 0 outermost)."""
    depth = 0
    while module.endswith(BASE_LAYER):
        module, depth = module[: -len(BASE_LAYER)], depth + 1
    return module, depth


def expert_targets(
    module: str, config: ExpertConfig, targets: dict, rename: Callable[[str], str | None]
) -> list[tuple[str, ExpertLoRA]]:
    """[(transformers parameter name, its ExpertLoRA)] of `module`'s targeted expert stacks, the
    up projection first (PEFT's nesting order: innermost first)."""
    found = []
    for wanted in config.target_parameters:
        short = wanted.rpartition(".")[2]
        key = f"{module}.{short}"
        if short not in STACKED_NAMES or not (key == wanted or key.endswith(f".{wanted}")):
            continue
        renamed = rename(key)
        if renamed is None:
            continue
        head, _, last = renamed.rpartition(".")
        target = targets.get(f"{head}.{STACKED_NAMES.get(last, last)}")
        if isinstance(target, ExpertLoRA) and all(t is not target for _, t in found):
            found.append((key, target))
    return sorted(found, key=lambda found: found[1].name.endswith(".down_proj"))


def read_experts(
    name: str, module: str, wrappers: list, experts: list, config: ExpertConfig, max_rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{ExpertLoRA name: (A (E, r, in), scaled B (E, out, r)) for this rank}. wrappers: [(depth,
    A, B)] of one module; experts: expert_targets' list. Raises AdapterError."""
    from baton.engine.lora.adapter import AdapterError

    free = list(experts)
    pairs = {}
    for _, a, b in sorted(wrappers, key=lambda w: -w[0]):  # innermost first
        fit = next((e for e in free if _fits(e[1], a, b)), None)
        if fit is None:
            raise AdapterError(
                f"adapter {name!r}: {module} has expert tensors A {tuple(a.shape)}, B "
                f"{tuple(b.shape)} that fit none of its targeted expert parameters "
                f"({', '.join(key for key, _ in free) or 'none left'})"
            )
        free.remove(fit)
        key, target = fit
        E = target.num_experts
        r, scaling = config.rank_and_scaling(key)
        if a.shape[0] != r * E:
            raise AdapterError(
                f"adapter {name!r}: {key} has A {tuple(a.shape)}, not (rank {r} x {E} experts, "
                "in) as its config's r / rank_pattern say"
            )
        if r > max_rank:
            raise AdapterError(
                f"adapter {name!r}: {key} has rank {r} (rank_pattern), which exceeds "
                f"--max-lora-rank {max_rank}"
            )
        a = a.reshape(E, r, a.shape[1])
        b = b.reshape(b.shape[0], r, E).permute(2, 0, 1)  # (E, out, r)
        rule = target.shard_rule
        if isinstance(rule, Slices) and rule.dim % 3 == 1:
            b = rule(b)  # the up projection's intermediate rows of this TP rank
        elif isinstance(rule, Slices):
            a = rule(a)  # the down projection's intermediate columns
        pairs[target.name] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return pairs


def _fits(target: ExpertLoRA, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether A (r E, in) and B (out, r E) are shaped for `target`'s full (unsliced) stack."""
    E = target.num_experts
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % E or b.shape[1] != a.shape[0]:
        return False
    rule = target.shard_rule
    sliced = rule.dim % 3 if isinstance(rule, Slices) else None
    for size, local, dim in ((a.shape[1], target.in_features, 2), (b.shape[0], target.out_features, 1)):  # fmt: skip
        if sliced != dim and size != local:
            return False
        if sliced == dim and max(start + length for start, length in rule.ranges) > size:
            return False
    return True


# Per-expert adapters as PEFT wrote them for transformers 4 (`<experts>.{e}.gate_proj.lora_A`
# ...): transformers 5 + PEFT 0.21 load them only for the model types whose checkpoint
# conversion PEFT mirrors for adapters (`_MOE_TARGET_MODULE_MAPPING`: Qwen2-MoE's pattern, which
# Qwen3-Next takes; Mixtral's). Of baton's families that is Qwen3-Next; elsewhere they are
# refused (the reference would not apply them).
PER_EXPERT_ARCHITECTURES = frozenset({"Qwen3NextForCausalLM"})
PER_EXPERT = re.compile(
    r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$"
)


def stack_per_expert(
    name: str, experts: str, projections: dict, config: ExpertConfig, up: ExpertLoRA
) -> tuple[list, ExpertConfig]:
    """PEFT's own conversion of one module's per-expert tensors {proj: {e: (A (r, in), B (out,
    r))}} into its target_parameters form: ([(depth, A (r' E, in), B (out, r' E))], the config
    with PEFT's rank/alpha patterns). SwiGLU: gate_up's A is [A_gate; A_up] and B the block
    diagonal of B_gate and B_up, rank 2 r and alpha 2 alpha. up: the experts' up stack."""
    from baton.engine.lora.adapter import AdapterError

    swiglu, count = up.swiglu, up.num_experts
    fused = ("gate_proj", "up_proj") if swiglu else ("up_proj",)
    up_name = "gate_up_proj" if swiglu else "up_proj"
    wrappers = []
    for depth, parts, param in ((1, fused, up_name), (0, ("down_proj",), "down_proj")):
        if not any(p in projections for p in parts):
            continue
        if any(sorted(projections.get(p, {})) != list(range(count)) for p in parts):
            raise AdapterError(
                f"adapter {name!r}: {experts} has per-expert {'/'.join(parts)} tensors that do "
                f"not cover experts 0..{count - 1} for each of {', '.join(parts)} (they are "
                f"fused into {param})"
            )
        a = torch.stack([torch.cat([projections[p][e][0] for p in parts]) for e in range(count)])
        b = torch.stack(
            [torch.block_diag(*[projections[p][e][1] for p in parts]) for e in range(count)], -1
        )
        wrappers.append((depth, a.flatten(0, 1), b.flatten(1, 2)))
    converted = replace(config, target_parameters=(up_name, "down_proj"))
    if swiglu:
        pattern = rf".*\.{up_name}"
        converted = replace(
            converted,
            rank_pattern=config.rank_pattern | {pattern: 2 * config.r},
            alpha_pattern=config.alpha_pattern | {pattern: 2 * config.alpha},
        )
    return wrappers, converted


def per_expert_stack(
    module: str, targets: dict, rename: Callable[[str], str | None]
) -> ExpertLoRA | None:
    """The up stack of the experts a per-expert module belongs to, where this model reads
    per-expert adapters (PER_EXPERT_ARCHITECTURES); else None."""
    match = PER_EXPERT.match(module)
    renamed = rename(f"{match['experts']}.up_proj") if match else None
    target = targets.get(renamed) if renamed else None
    return target if isinstance(target, ExpertLoRA) and target.reads_per_expert else None
