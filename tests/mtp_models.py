"""Tiny NemotronH checkpoints with an MTP layer, for the speculative-decoding tests.

transformers builds no MTP layer (its NemotronH skips `mtp.*`), so a tiny model is saved by
transformers as usual (tests/tiny.py) and its directory is given random MTP weights under the
names published checkpoints use (`mtp.layers.{j}.{enorm,hnorm,eh_proj,norm,mixer.*,
final_layernorm}`, experts one tensor each) and `num_nextn_predict_layers: 1` plus
`mtp_layers_block_type` in config.json. The shapes come from baton's own MTP head built for
that config, so the file holds exactly what a checkpoint of that architecture would.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from baton.engine.config import ModelConfig
from baton.engine.models.nemotron_h import NemotronHMTP

STACKED_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>\w+)$")


def mtp_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the config's MTP layer, as a checkpoint stores them."""
    torch.manual_seed(seed)
    head = NemotronHMTP(config.hidden_size, config.family)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in head.named_parameters():
        name = "mtp." + name
        if name.endswith("e_score_correction_bias"):
            value = 0.05 * torch.randn(param.shape)
        elif "norm" in name:
            value = 1.0 + 0.1 * torch.randn(param.shape)
        else:
            value = torch.randn(param.shape) * (0.5 / math.sqrt(param.shape[-1]))
        stacked = STACKED_EXPERT.match(name)
        if stacked is None:
            tensors[name] = value.contiguous()
            continue
        for e in range(value.shape[0]):
            tensors[f"{stacked['prefix']}.{e}.{stacked['proj']}.weight"] = value[e].contiguous()
    return tensors


def add_mtp_layer(
    source: Path, dest: Path, block_types: list[str], seed: int = 7
) -> dict[str, torch.Tensor]:
    """Copy the model directory `source` to `dest` with an MTP layer of `block_types`
    (transformers' names: "full_attention", "moe"). Returns the MTP tensors written."""
    shutil.copytree(source, dest)
    config_path = dest / "config.json"
    raw = json.loads(config_path.read_text())
    raw["num_nextn_predict_layers"] = 1
    raw["mtp_layers_block_type"] = block_types
    raw.pop("mtp_hybrid_override_pattern", None)
    config_path.write_text(json.dumps(raw, indent=2))
    tensors = mtp_weights(ModelConfig.from_hf(dest), seed)
    weights = load_file(str(dest / "model.safetensors"))
    save_file({**weights, **tensors}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return tensors
