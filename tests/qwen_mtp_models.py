"""Tiny Qwen gated DeltaNet hybrids (tests/gdn_families.py) with an MTP layer, for the
speculative-decoding tests.

transformers builds no MTP layer (its Qwen3-Next and Qwen3.5 skip `mtp.*`), so a tiny model
saved by transformers gets random MTP weights under the published names: `mtp.fc` (hidden,
2 hidden), `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, norm}`, and `mtp.layers.0.*` a
full-attention decoder layer stored as the checkpoint stores the model's own: its attention and
norms shaped as a full-attention layer's, its MLP as layer 0's (dense or MoE, in the format
transformers saved). At the checkpoint's top level, also beside a vision checkpoint's
`model.language_model.`; the layer count under the family's key in config.json.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def body_prefix(weights: dict[str, torch.Tensor]) -> str:
    """Where the language model's layers sit in the checkpoint."""
    vision = any(n.startswith("model.language_model.") for n in weights)
    return "model.language_model." if vision else "model."


def random_like(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    if "norm" in name:  # zero-centred norms: scales near 1
        return 0.1 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[-1]))


def mtp_weights(weights: dict[str, torch.Tensor], layer_types: list[str], seed: int):
    """Random MTP tensors shaped after the checkpoint `weights` (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    layers = body_prefix(weights) + "layers."
    attention = f"{layers}{layer_types.index('full_attention')}."
    template = {
        name[len(attention) :]: t.shape
        for name, t in weights.items()
        if name.startswith(attention) and ".mlp." not in f".{name[len(attention) :]}"
    }
    template |= {
        n[len(layers) + 2 :]: t.shape for n, t in weights.items() if n.startswith(f"{layers}0.mlp.")
    }
    hidden = weights[body_prefix(weights) + "embed_tokens.weight"].shape[1]
    tensors = {f"mtp.layers.0.{n}": random_like(n, s, g) for n, s in sorted(template.items())}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = random_like(name, torch.Size([hidden]), g)
    tensors["mtp.fc.weight"] = random_like("fc", torch.Size([hidden, 2 * hidden]), g)
    return tensors


def add_qwen_mtp_layer(source: Path, dest: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """Copy the model directory `source` to `dest` with one MTP layer. Returns its tensors."""
    shutil.copytree(source, dest)
    config_path = dest / "config.json"
    raw = json.loads(config_path.read_text())
    text = raw.get("text_config", raw)
    key = (
        "num_nextn_predict_layers" if raw["model_type"] == "qwen3_next" else "mtp_num_hidden_layers"
    )
    text[key] = 1
    config_path.write_text(json.dumps(raw, indent=2))
    weights = load_file(str(dest / "model.safetensors"))
    tensors = mtp_weights(weights, text["layer_types"], seed)
    save_file({**weights, **tensors}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return tensors
