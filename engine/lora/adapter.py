"""Read a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, as
`save_pretrained` writes them) onto baton's adapted projections (engine/lora/layer.py).

Tensor names are PEFT's: `base_model.model.<transformers module>.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r). The module name goes through the family's `checkpoint_name` (the
same map the base checkpoint's names take) to baton's in-memory module. Everything the adapter
asks for is applied or the adapter is refused with what is wrong named (AdapterError): a
module baton cannot adapt, a shape that differs from the base's, a rank over max_lora_rank, and
the PEFT options baton does not implement (modules_to_save, bias, DoRA, rank/alpha patterns on
anything but routed experts, target_parameters on anything but routed experts' stacked
projections, per-expert v4 tensors, embedding adapters). Nothing is silently dropped. Routed
experts (`target_parameters`): engine/lora/expert_adapter.py.

B is scaled here (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) and both are sliced
for this TP rank by the base weight's rule: a column-parallel base (rows sliced) slices B's rows,
a row-parallel base (columns sliced) slices A's columns.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from baton.engine.lora.expert_adapter import (
    PER_EXPERT,
    ExpertConfig,
    container,
    expert_targets,
    per_expert_stack,
    read_experts,
    stack_per_expert,
)
from baton.engine.lora.layer import LoRALinear
from baton.engine.parallel import Slices

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter baton refuses; the message names the adapter and what is wrong."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRAWeights:
    """One adapter read for this rank, in host memory: {in-memory module name: (A (r, in),
    B (out, r) scaled)}, and {expert stack name: (A (E, r, in), B (E, out, r) scaled)}; r is the
    config's, a module's own the rows of its A."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _config(name: str, root: Path, max_rank: int) -> tuple[int, float, ExpertConfig]:
    """(r, scaling, what expert adapters read) after every refusal the config alone decides."""
    file = root / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"adapter {name!r}: {file} not found")
    if not (root / WEIGHTS_FILE).is_file():
        raise AdapterError(f"adapter {name!r}: {root / WEIGHTS_FILE} not found")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: {file} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    refusals = {
        "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
        "layers_to_transform": "layers_to_transform is not supported",
        "use_dora": "use_dora (DoRA) is not supported",
        "lora_bias": "lora_bias is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {why} (it sets {key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')"
        )
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {r} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    _check_patterns(name, config)
    return r, float(scaling), ExpertConfig.of(config, r, alpha)


def _check_patterns(name: str, config: dict) -> None:
    """target_parameters a list of names; rank_pattern / alpha_pattern {regex: positive int /
    number} (whether they touch only experts is decided per module, in _read)."""
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"adapter {name!r}: target_parameters must be a list of parameter names")
    for field, number in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict) or not all(
            isinstance(v, number) and not isinstance(v, bool) and v > 0 for v in patterns.values()
        ):
            raise AdapterError(f"adapter {name!r}: {field} must map patterns to positive numbers")


def _module_names(name: str, keys: list[str]) -> dict[str, dict[str, str]]:
    """{PEFT module name: {"A": tensor key, "B": tensor key}}; refuses other tensors."""
    modules: dict[str, dict[str, str]] = {}
    for key in keys:
        bare = key.removeprefix(PREFIX)
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if bare.endswith(suffix):
                modules.setdefault(bare[: -len(suffix)], {})[part] = key
                break
        else:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight baton can apply "
                "(embedding adapters, biases and saved modules are not supported)"
            )
    for module, parts in modules.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} has lora_{''.join(parts)} only")
    return modules


def read_adapter(
    name: str,
    path: str | Path,
    targets: dict[str, LoRALinear],
    rename: Callable[[str], str | None],
    max_rank: int,
) -> LoRAWeights:
    """Read, check and slice the adapter at `path` for this rank's `targets` (in-memory module
    name -> its wrapper); `rename` is the family's checkpoint_name."""
    root = Path(path)
    r, scaling, experts = _config(name, root, max_rank)
    try:
        return _read(name, root, targets, rename, r, scaling, experts, max_rank)
    except AdapterError:
        raise
    except Exception as error:  # a damaged file: safetensors' own errors, bad dtypes
        raise AdapterError(
            f"adapter {name!r}: cannot read {root / WEIGHTS_FILE}: {error}"
        ) from None


def _read(name, root: Path, targets, rename, r, scaling, experts, max_rank) -> LoRAWeights:
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    wrapped: dict[str, list] = {}  # expert container -> [(depth, A, B)] of its ParamWrappers
    per_expert: dict[str, dict] = {}  # expert container -> {proj: {e: (A, B)}} (transformers 4)
    with safe_open(str(root / WEIGHTS_FILE), framework="pt") as file:
        modules = _module_names(name, list(file.keys()))
        if not modules:
            raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
        for module, parts in sorted(modules.items()):
            a, b = file.get_tensor(parts["A"]), file.get_tensor(parts["B"])
            outer, depth = container(module)
            if expert_targets(outer, experts, targets, rename):
                wrapped.setdefault(outer, []).append((depth, a, b))
                continue
            if per_expert_stack(module, targets, rename) is not None:
                match = PER_EXPERT.match(module)
                projections = per_expert.setdefault(match["experts"], {})
                projections.setdefault(match["proj"], {})[int(match["e"])] = (a, b)
                continue
            target = _target(name, module, targets, rename, experts)
            weights[target.name] = _fit(name, module, target, a, b, r, scaling)
    for module, wrappers in wrapped.items():
        found = expert_targets(module, experts, targets, rename)
        weights |= read_experts(name, module, wrappers, found, experts, max_rank)
    for module, projections in per_expert.items():
        up = per_expert_stack(f"{module}.0.up_proj", targets, rename)
        stacked, converted = stack_per_expert(name, module, projections, experts, up)
        found = expert_targets(module, converted, targets, rename)
        weights |= read_experts(name, module, stacked, found, converted, max_rank)
    return LoRAWeights(name=name, path=str(root), rank=r, weights=weights)


def _target(name, module: str, targets, rename, experts: ExpertConfig) -> LoRALinear:
    """The adapted projection PEFT's `module` is, or AdapterError naming why not."""
    renamed = rename(f"{module}.weight")
    target = targets.get(renamed.removesuffix(".weight")) if renamed else None
    if re.search(r"\.experts\.\d+\.", module):
        raise AdapterError(
            f"adapter {name!r} targets {module}, one routed expert's own projection (a per-expert "
            "adapter as PEFT wrote them for transformers 4): transformers 5 + PEFT convert those "
            "for Qwen3-Next only, and so does baton; elsewhere save the adapter for "
            "transformers 5's stacked experts (target_parameters)"
        )
    if not isinstance(target, LoRALinear):
        raise AdapterError(
            f"adapter {name!r} targets {module}, which baton cannot apply an adapter to "
            f"(adaptable: attention q/k/v/o, Mamba in_proj/out_proj, GDN projections, "
            "MLP gate/up/down, routed experts' stacked projections through target_parameters)"
        )
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = experts.pattern(getattr(experts, field), module)
        if pattern is not None:
            raise AdapterError(
                f"adapter {name!r}: {field} {pattern!r} applies to {module}; baton reads "
                f"{field} for routed experts' parameters only"
            )
    return target


def _fit(name, module, target: LoRALinear, a, b, r, scaling):
    """Check shapes against the full base (before TP slicing) and slice for this rank."""
    rule = target.shard_rule
    rows = rule if isinstance(rule, Slices) and rule.dim == 0 else None
    cols = rule if isinstance(rule, Slices) and rule.dim in (1, -1) else None
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
        raise AdapterError(
            f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
            f"not (r={r}, in) and (out, r={r})"
        )
    for what, size, local, ranges in (
        ("input", a.shape[1], target.in_features, cols),
        ("output", b.shape[0], target.out_features, rows),
    ):
        fits = (
            size == local
            if ranges is None
            else max(start + length for start, length in ranges.ranges) <= size
        )
        if not fits:
            raise AdapterError(
                f"adapter {name!r}: {module} has {what} size {size}, the model's projection "
                f"{target.name} does not match it"
            )
    if cols is not None:
        a = cols(a)
    if rows is not None:
        b = rows(b)
    if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
        raise AdapterError(
            f"adapter {name!r}: {module} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}; "
            f"{target.name} is ({target.out_features}, {target.in_features}) on this rank"
        )
    return a.float().contiguous(), (b.float() * scaling).contiguous()
