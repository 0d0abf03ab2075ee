"""Read safetensors checkpoints (single file or sharded with an index) from an HF directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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


def tensor_names(model_dir: str | Path) -> set[str]:
    """Canonical names of every tensor in the checkpoint (headers only, no data read)."""
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            names.update(canonical_name(n) for n in shard.keys())
    return names


def canonical_name(name: str) -> str:
    """On-disk NemotronH names use `backbone.`; baton's modules use `model.`."""
    if name.startswith("backbone."):
        return "model." + name[len("backbone.") :]
    return name


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, tensor) for every tensor of every shard, with a progress bar for
    multi-shard checkpoints."""
    files = checkpoint_files(model_dir)
    for path in tqdm(files, desc="Loading shards", disable=len(files) < 2, unit="shard"):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                yield canonical_name(name), shard.get_tensor(name)


def load_into(module: torch.nn.Module, model_dir: str | Path, ignore: tuple[str, ...] = ()) -> None:
    """Copy every checkpoint tensor into the parameter of the same name, casting to its dtype.

    Raises WeightError naming missing tensors, unexpected tensors and shape mismatches.
    """
    params = dict(module.named_parameters())
    tied = set(getattr(module, "tied_parameters", ()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iterate_weights(model_dir):
        if name in tied:
            continue  # shares its storage with a parameter loaded under another name
        param = params.get(name)
        if param is None:
            if not any(name.startswith(prefix) for prefix in ignore):
                unexpected.append(name)
            continue
        if tuple(param.shape) != tuple(tensor.shape):
            raise WeightError(
                f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightError(f"{model_dir}: checkpoint is missing tensor(s) {missing}")
    if unexpected:
        raise WeightError(f"{model_dir}: checkpoint has unexpected tensor(s) {sorted(unexpected)}")
