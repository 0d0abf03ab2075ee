"""The model registry: config.json's `architectures` (else `model_type`) -> the family module.

A family module (engine/models/<family>.py) declares everything about its family:
    HF_CONFIG_CLASS_PATH      the transformers config class whose defaults fill missing keys
    read_config(reader)       -> ModelConfig (engine/config.py) with the family's own config in
                              `family`, every key read or refused
    state_spec(config, dtype) -> ModelStateSpec: the state every layer use keeps
    Model                     the nn.Module built from ModelConfig, weights named as on disk
and, where it has them, its capabilities:
    check_tp(config, size)    ConfigError unless `size` ranks can serve the model (a family
                              without it refuses TP > 1)
    checkpoint_name(name)     the in-memory name of a checkpoint tensor, None to skip it
    checkpoint_renamer(cfg)   optional: that function for a config, where names depend on it
                              (default: the name itself)
    UNTIE_WITH_STORED_LM_HEAD True: a checkpoint that stores lm_head.weight uses it whatever
                              tie_word_embeddings says (transformers' NemotronH never ties)
Modules are imported when their family is asked for, so a registry lookup costs nothing.
`register` adds a family (a test's, or a plugin's) without editing this file; it also notes the
family in `BATON_FAMILIES` ("Architecture=model_type:module,..."), which the registry reads at
import, so the processes an engine starts (tensor-parallel ranks, a server's engine) serve it
too.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from baton.engine.config_defaults import config_defaults
from baton.engine.config_error import ConfigError

# architecture -> (model_type, family module)
FAMILIES: dict[str, tuple[str, str]] = {
    "NemotronHForCausalLM": ("nemotron_h", "baton.engine.models.nemotron_h"),
    "BambaForCausalLM": ("bamba", "baton.engine.models.bamba"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "baton.engine.models.granite_moe_hybrid"),
    "FalconH1ForCausalLM": ("falcon_h1", "baton.engine.models.falcon_h1"),
    "Zamba2ForCausalLM": ("zamba2", "baton.engine.models.zamba2"),
    "Qwen3NextForCausalLM": ("qwen3_next", "baton.engine.models.qwen3_next"),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", "baton.engine.models.qwen3_5"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "baton.engine.models.qwen3_5"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", "baton.engine.models.qwen3_5_moe"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "baton.engine.models.qwen3_5_moe"),
    "OlmoHybridForCausalLM": ("olmo_hybrid", "baton.engine.models.olmo_hybrid"),
    "JambaForCausalLM": ("jamba", "baton.engine.models.jamba"),
    "Lfm2ForCausalLM": ("lfm2", "baton.engine.models.lfm2"),
    "Lfm2MoeForCausalLM": ("lfm2_moe", "baton.engine.models.lfm2_moe"),
    "Lfm3ForCausalLM": ("lfm3", "baton.engine.models.lfm3"),
    "MambaForCausalLM": ("mamba", "baton.engine.models.mamba"),
    "Mamba2ForCausalLM": ("mamba2", "baton.engine.models.mamba2"),
    "FalconMambaForCausalLM": ("falcon_mamba", "baton.engine.models.falcon_mamba"),
    "KimiLinearForCausalLM": ("kimi_linear", "baton.engine.models.kimi_linear"),
    "BailingHybridForCausalLM": ("bailing_hybrid", "baton.engine.models.bailing_hybrid"),
    "RecurrentGemmaForCausalLM": ("recurrent_gemma", "baton.engine.models.recurrent_gemma"),
    "MiniMaxForCausalLM": ("minimax", "baton.engine.models.minimax"),
}


FAMILIES_ENV = "BATON_FAMILIES"


def register(architecture: str, model_type: str, module: str) -> None:
    """Serve `architecture` (config.json's `architectures[0]`, or `model_type`) with the family
    module at import path `module`, here and in the processes started from here."""
    FAMILIES[architecture] = (model_type, module)
    entries = [e for e in os.environ.get(FAMILIES_ENV, "").split(",") if e]
    entry = f"{architecture}={model_type}:{module}"
    if entry not in entries:
        os.environ[FAMILIES_ENV] = ",".join([*entries, entry])


def _registered_by_environment() -> None:
    for entry in filter(None, os.environ.get(FAMILIES_ENV, "").split(",")):
        architecture, _, rest = entry.partition("=")
        model_type, _, module = rest.partition(":")
        if not (architecture and model_type and module):
            raise ConfigError(f"{FAMILIES_ENV}: {entry!r} is not Architecture=model_type:module")
        FAMILIES[architecture] = (model_type, module)


_registered_by_environment()


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    architecture: str
    module: ModuleType

    def hf_config_defaults(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(keyword defaults, rope defaults) of HF_CONFIG_CLASS_PATH, kept per machine."""
        return config_defaults(self.module.HF_CONFIG_CLASS_PATH)

    def read_config(self, reader) -> Any:
        return self.module.read_config(reader)

    def state_spec(self, config, dtype) -> Any:
        return self.module.state_spec(config, dtype)

    @property
    def check_tp(self) -> Callable[[Any, int], None] | None:
        return getattr(self.module, "check_tp", None)

    def checkpoint_name(self, name: str) -> str | None:
        rename = getattr(self.module, "checkpoint_name", None)
        return name if rename is None else rename(name)

    def checkpoint_renamer(self, config) -> Callable[[str], str | None]:
        """checkpoint_name for this model's config: a family whose names depend on it (Bailing's
        MTP layer, stored after the decoder's num_hidden_layers) gives `checkpoint_renamer`."""
        make = getattr(self.module, "checkpoint_renamer", None)
        return self.checkpoint_name if make is None else make(config)

    @property
    def untie_with_stored_lm_head(self) -> bool:
        return getattr(self.module, "UNTIE_WITH_STORED_LM_HEAD", False)

    @property
    def model_class(self) -> type:
        return self.module.Model


def model_state_spec(config, dtype) -> Any:
    """The ModelStateSpec of a ModelConfig's family, at the serving dtype."""
    return family_named(config.architecture).state_spec(config, dtype)


def supported_architectures() -> tuple[str, ...]:
    return tuple(FAMILIES)


def tp_architectures() -> tuple[str, ...]:
    """The families that declare a tensor-parallel check."""
    return tuple(a for a in FAMILIES if family_named(a).check_tp is not None)


def family_named(architecture: str) -> Family:
    """The family of a ModelConfig's `architecture` (one family_for already accepted)."""
    return Family(
        architecture=architecture, module=importlib.import_module(FAMILIES[architecture][1])
    )


def family_for(hf: dict[str, Any], source: str = "config.json") -> Family:
    """The family of a config.json (see architecture_for)."""
    return family_named(architecture_for(hf, source))


def architecture_for(hf: dict[str, Any], source: str = "config.json") -> str:
    """The architecture baton serves a config.json as: `architectures[0]` decides; a file without
    it, or naming an architecture baton does not know, is looked up by `model_type`, as
    transformers' Auto classes load it (inclusionAI's Ling 3.0 releases name
    `BailingMoeV3ForCausalLM` for model_type `bailing_hybrid`). Anything else is refused with the
    list of what baton serves. Imports no family module (nor torch): the server checks this
    before it starts an engine."""
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = architectures[0] if architectures else None
    if arch not in FAMILIES:
        by_type = next((a for a, (t, _) in FAMILIES.items() if t == model_type), None)
        arch = arch if by_type is None else by_type
    if arch not in FAMILIES:
        named = (
            f"architecture {architectures[0]!r} (key 'architectures')"
            if architectures
            else f"model_type {model_type!r} (no key 'architectures')"
        )
        supported = ", ".join(f"{a} ({t})" for a, (t, _) in FAMILIES.items())
        raise ConfigError(f"{source}: unsupported {named}; baton serves {supported}")
    return arch
