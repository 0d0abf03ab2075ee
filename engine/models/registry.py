"""The model registry: config.json's `architectures` (else `model_type`) -> the family module.

A family module (engine/models/<family>.py) provides:
    HF_CONFIG_CLASS_PATH   the transformers config class whose defaults fill missing keys
    read_config(reader)    -> ModelConfig (engine/config.py), every key read or refused
    state_spec(config, dtype) -> ModelStateSpec: the state every layer use keeps
    Model                  the nn.Module built from ModelConfig, weights named as on disk
Modules are imported when their family is asked for, so a registry lookup costs nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from engine.config import ConfigError

# architecture -> (model_type, family module)
FAMILIES: dict[str, tuple[str, str]] = {
    "NemotronHForCausalLM": ("nemotron_h", "engine.models.nemotron_h"),
    "BambaForCausalLM": ("bamba", "engine.models.bamba"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "engine.models.granite_moe_hybrid"),
    "FalconH1ForCausalLM": ("falcon_h1", "engine.models.falcon_h1"),
    "Zamba2ForCausalLM": ("zamba2", "engine.models.zamba2"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    architecture: str
    module: ModuleType

    def hf_config_class(self) -> type:
        module_path, name = self.module.HF_CONFIG_CLASS_PATH.rsplit(".", 1)
        return getattr(importlib.import_module(module_path), name)

    def read_config(self, reader) -> Any:
        return self.module.read_config(reader)

    def state_spec(self, config, dtype) -> Any:
        return self.module.state_spec(config, dtype)

    @property
    def model_class(self) -> type:
        return self.module.Model


def model_state_spec(config, dtype) -> Any:
    """The ModelStateSpec of a ModelConfig's family, at the serving dtype."""
    return family_named(config.architecture).state_spec(config, dtype)


def supported_architectures() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_named(architecture: str) -> Family:
    """The family of a ModelConfig's `architecture` (one family_for already accepted)."""
    return Family(
        architecture=architecture, module=importlib.import_module(FAMILIES[architecture][1])
    )


def family_for(hf: dict[str, Any], source: str = "config.json") -> Family:
    """The family of a config.json. `architectures[0]` decides; a file without it is looked up
    by `model_type`. Anything else is refused with the list of what baton serves."""
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = architectures[0] if architectures else None
    if arch is None:
        arch = next((a for a, (t, _) in FAMILIES.items() if t == model_type), None)
    if arch not in FAMILIES:
        named = (
            f"architecture {architectures[0]!r} (key 'architectures')"
            if architectures
            else f"model_type {model_type!r} (no key 'architectures')"
        )
        supported = ", ".join(f"{a} ({t})" for a, (t, _) in FAMILIES.items())
        raise ConfigError(f"{source}: unsupported {named}; baton serves {supported}")
    return family_named(arch)
