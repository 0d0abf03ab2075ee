"""Read safetensors checkpoints (single file or sharded with an index) from an HF directory."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from baton.engine.parallel import ShardRule, Slices, shard_rule

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# One routed expert's matrix as checkpoints store it (transformers' save_pretrained and NVIDIA's
# Nemotron 3 releases alike): `...mixer.experts.{e}.up_proj.weight`. In memory the experts of a
# layer are one stacked (E, out, in) parameter `...mixer.experts.up_proj`, as in transformers;
# a quantized stack is a module whose stacked tensors keep the stored names
# (`...experts.up_proj.weight_scale` from each `...experts.{e}.up_proj.weight_scale`).
EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.(?P<tensor>\w+)$"
)
# Multi-token-prediction layers (Nemotron 3 Super): loaded only into a model built with its MTP
# head (speculative decoding with method "mtp"), skipped otherwise.
SKIPPED_PREFIXES = ("mtp.",)
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertParts:
    """A stacked (E, rows, in) expert parameter whose checkpoint stores each expert's rows as
    separate tensors `{prefix}.{e}.{name}.weight`, one per name, stacked along the rows in this
    order (SwiGLU experts saved as gate_proj and up_proj: Jamba, LFM2-MoE). `rule`: the TP slice
    one part's tensor is read with (None: whole)."""

    names: tuple[str, ...]
    rule: ShardRule | None


def expert_parts(param: torch.Tensor, parts: ExpertParts) -> None:
    """Declare that `param` is loaded from per-expert parts (set by the layer that owns it)."""
    param._baton_expert_parts = parts


def _parts_index(params: dict[str, torch.Tensor]) -> dict[str, tuple[str, int, ExpertParts]]:
    """'{prefix}.{part name}' -> (stacked parameter, part index, its ExpertParts)."""
    index = {}
    for name, param in params.items():
        parts = getattr(param, "_baton_expert_parts", None)
        if parts is not None:
            prefix = name.rsplit(".", 1)[0]
            for i, part in enumerate(parts.names):
                index[f"{prefix}.{part}"] = (name, i, parts)
    return index


class WeightError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor or file."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise WeightError(f"{index}: missing key 'weight_map'")
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightError(f"{index} lists shard files that do not exist: {missing}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    shards = sorted(root.glob("model-*.safetensors"))
    if shards:
        return shards
    raise WeightError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or model-*.safetensors found")


# A checkpoint tensor's in-memory name, None to skip it (the family's `checkpoint_name`).
Rename = Callable[[str], str | None]


def keep_name(name: str) -> str:
    return name


def tensor_names(model_dir: str | Path, rename: Rename = keep_name) -> set[str]:
    """In-memory names of every tensor in the checkpoint (headers only, no data read)."""
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            names.update(n for n in map(rename, shard.keys()) if n is not None)
    return names


class CheckpointTensor:
    """One tensor of an open shard, read only when asked: whole, or only the slice a
    tensor-parallel rank holds (the other bytes are never read from the file)."""

    def __init__(self, shard, name: str):
        self.shard, self.name = shard, name

    def read(self, rule: ShardRule | None) -> torch.Tensor:
        if isinstance(rule, Slices):
            part = self.shard.get_slice(self.name)
            return rule.read(part, tuple(part.get_shape()))
        tensor = self.shard.get_tensor(self.name)
        return tensor if rule is None else rule(tensor)


def iterate_weights(
    model_dir: str | Path, rename: Rename = keep_name
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (in-memory name, tensor to read) for every tensor of every shard that `rename`
    keeps, with a progress bar for multi-shard checkpoints."""
    files = checkpoint_files(model_dir)
    for path in tqdm(files, desc="Loading shards", disable=len(files) < 2, unit="shard"):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                renamed = rename(name)
                if renamed is not None:
                    yield renamed, CheckpointTensor(shard, name)


def expert_slot(
    name: str,
    params: dict[str, torch.Tensor],
    parts_of: dict[str, tuple[str, int, ExpertParts]],
) -> tuple[str, int, int, ExpertParts | None] | None:
    """(stacked parameter, expert index, part, its ExpertParts or None) for a per-expert
    checkpoint tensor, else None: a weight goes into its stacked parameter (into its part's rows
    where the stack joins several per-expert projections), any other tensor (a quantized
    expert's `weight_scale`) into the stacked tensor of its own name."""
    match = EXPERT_NAME.match(name)
    if match is None:
        return None
    stacked, index = f"{match['prefix']}.{match['proj']}", int(match["index"])
    if match["tensor"] == "weight":
        if stacked in parts_of:
            target, part, parts = parts_of[stacked]
            return target, index, part, parts
        if stacked in params:
            return stacked, index, 0, None
    if f"{stacked}.{match['tensor']}" in params:
        return f"{stacked}.{match['tensor']}", index, 0, None
    return None


def load_into(
    module: torch.nn.Module,
    model_dir: str | Path,
    rename: Rename = keep_name,
    ignore: tuple[str, ...] = (),
) -> None:
    """Copy every checkpoint tensor into the parameter of the same name, casting to its dtype;
    per-expert tensors go into their row of the stacked expert parameter. A parameter that
    holds a tensor-parallel shard carries its rule (engine/parallel.py, set by the layer that
    owns it) and takes only its slice of the checkpoint tensor.

    Raises WeightError naming missing tensors (a missing expert by its checkpoint name),
    unexpected tensors and shape mismatches. MTP tensors are skipped with one log line unless
    the module has an MTP head to load them into.
    """
    params = dict(module.named_parameters())
    parts_of = _parts_index(params)
    skipped_prefixes = tuple(
        prefix for prefix in SKIPPED_PREFIXES if not any(n.startswith(prefix) for n in params)
    )
    tied = set(getattr(module, "tied_parameters", ()))
    loaded: set[str] = set()
    # stacked parameter -> (expert, part) rows loaded (part 0 where the expert is one tensor)
    experts_loaded: dict[str, set[tuple[int, int]]] = {}
    unexpected: list[str] = []
    skipped = 0
    for name, checkpoint in iterate_weights(model_dir, rename):
        if name in tied:
            continue  # shares its storage with a parameter loaded under another name
        if name.startswith(skipped_prefixes):
            skipped += 1
            continue
        target, index, part, parts = name, None, 0, None
        slot = expert_slot(name, params, parts_of) if name not in params else None
        if slot is not None:
            target, index, part, parts = slot
        param = params.get(target)
        if param is None:
            if not any(name.startswith(prefix) for prefix in ignore):
                unexpected.append(name)
            continue
        dest = param if index is None else _expert_row(param, index, name, model_dir)
        if parts is not None:
            dest = dest.chunk(len(parts.names), dim=0)[part]
        tensor = checkpoint.read(shard_rule(param) if parts is None else parts.rule)
        check = getattr(param, "check_checkpoint", None)
        if check is not None:  # a quantized tensor's value checks (engine/quantization)
            tensor = check(name, tensor)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightError(
                f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor.to(param.dtype))
        if index is None:
            loaded.add(target)
        else:
            experts_loaded.setdefault(target, set()).add((index, part))
    if skipped:
        log.info("%s: skipped %d multi-token-prediction (mtp.*) tensors", model_dir, skipped)
    missing = []
    for name in sorted(set(params) - loaded):
        rows = experts_loaded.get(name)
        if rows is None:
            missing.append(name)
            continue
        parts = getattr(params[name], "_baton_expert_parts", None)
        if parts is not None:
            prefix = name.rsplit(".", 1)[0]
            missing += [
                f"{prefix}.{e}.{part}.weight"
                for e in range(params[name].shape[0])
                for i, part in enumerate(parts.names)
                if (e, i) not in rows
            ]
        else:
            n = params[name].shape[0]
            missing += [_expert_name(name, e) for e in range(n) if (e, 0) not in rows]
    if missing:
        raise WeightError(f"{model_dir}: checkpoint is missing tensor(s) {missing}")
    if unexpected:
        raise WeightError(f"{model_dir}: checkpoint has unexpected tensor(s) {sorted(unexpected)}")


def _expert_name(stacked: str, index: int) -> str:
    """The checkpoint name of expert `index`'s part of a stacked parameter."""
    head, tail = stacked.split(".experts.", 1)
    proj, _, tensor = tail.partition(".")
    return f"{head}.experts.{index}.{proj}.{tensor or 'weight'}"


def _expert_row(param: torch.Tensor, index: int, name: str, model_dir) -> torch.Tensor:
    if index >= param.shape[0]:
        raise WeightError(
            f"{model_dir}: tensor {name!r} is expert {index}, the model has {param.shape[0]} experts"
        )
    return param[index]
