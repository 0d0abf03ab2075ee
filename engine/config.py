"""ModelConfig: a frozen, complete description of a checkpoint, read from config.json.

config.json's `architectures` (else `model_type`) picks the family (engine/models/registry.py);
the family's `read_config` fills one ModelConfig: the fields every family has (the only ones
the engine reads), and `family`, the family's own frozen config type, defined and read in its
family file (its layers' configs, multipliers, layout).

No defaults of baton's own: every field comes from the file (or from a documented alias /
derivation). A key the shapes cannot be guessed without (`hidden_size`, the layer layout...) is
required and its absence is an error that names it; any other missing key takes the default of
the family's transformers config class (read from the class, so the two cannot drift; kept per
machine and transformers version: engine/config_defaults.py), because that is what transformers
would run the same directory with. A key whose value baton cannot honour is a `ConfigError` that
names it. Defaults for *serving* live at the CLI boundary.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.engine.config_error import ConfigError

# The serving dtypes by name (engine/checkpoint/loader.py maps them to torch's); --dtype also
# takes vLLM's spellings and auto, the checkpoint's own dtype (its config.json), as vLLM does.
# Here, not beside the torch dtypes, so that the command line builds without importing torch.
SERVING_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "half": "float16"}
DTYPE_NAMES = ("auto", *SERVING_DTYPES, *DTYPE_ALIASES)
# What --quantization accepts (vLLM's spellings; engine/quantization reads them), here for the
# same reason.
QUANTIZATION_NAMES = ("fp8", "modelopt", "modelopt_fp4", "modelopt_mixed")


class ConfigReader:
    """config.json's keys for one family: `need` (required, no default), `opt` (the file's
    value, else the transformers class default), `has`."""

    def __init__(
        self,
        hf: dict[str, Any],
        source: str,
        defaults: dict[str, Any],
        rope_defaults: dict[str, Any] | None = None,
    ):
        """defaults: the config class's keyword defaults; rope_defaults: the rope parameters a
        default instance of it carries (transformers fills theta and partial rotary there)."""
        self.hf = hf
        self.source = source
        self.defaults = defaults
        self.rope_defaults = rope_defaults or {}

    def has(self, key: str) -> bool:
        return key in self.hf

    def need(self, key: str) -> Any:
        if key not in self.hf or self.hf[key] is None:
            raise ConfigError(f"{self.source}: missing required key {key!r}")
        return self.hf[key]

    def opt(self, key: str) -> Any:
        if key in self.hf:
            return self.hf[key]
        if key not in self.defaults:
            # transformers has no default for it either: the file must say it.
            raise ConfigError(f"{self.source}: missing required key {key!r}")
        return self.defaults[key]

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def require_multiple(self, key: str, value: int, of_key: str, of_value: int) -> None:
        """Heads shared evenly by groups (query heads by KV heads, Mamba heads by B/C groups):
        transformers' repeat fails on any other pair, baton would pair heads wrongly."""
        if of_value < 1 or value % of_value:
            raise self.error(f"{key}={value} must be a multiple of {of_key}={of_value}")

    def require(self, key: str, supported: tuple[Any, ...]) -> Any:
        """The key's value (or default), refused unless baton runs it."""
        value = self.opt(key)
        if value not in supported:
            raise self.error(
                f"{key}={value!r} is not supported (baton runs {', '.join(map(repr, supported))})"
            )
        return value

    def time_step_limit(self) -> tuple[float, float]:
        """transformers writes infinity as {"__float__": "Infinity"} (or null in old files)."""
        limit = self.opt("time_step_limit")
        if limit is None:
            return (0.0, math.inf)
        low, high = (math.inf if isinstance(v, dict) or v is None else float(v) for v in limit)
        return (low, high)

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.need("eos_token_id")
        return tuple(eos) if isinstance(eos, list) else (eos,)

    def torch_dtype(self) -> str:
        return self.hf.get("dtype") or self.hf.get("torch_dtype") or "bfloat16"

    def rotary(self, head_dim: int, partial: bool = True) -> RotaryConfig:
        """transformers 5 writes `rope_parameters` ({rope_type, rope_theta,
        partial_rotary_factor}); older files a top-level `rope_theta` (and `rope_scaling`).
        partial=False: the family's transformers code rotates whole heads whatever the factor
        says (Falcon-H1)."""
        params = self.hf.get("rope_parameters") or {}
        scaling = self.hf.get("rope_scaling") or {}
        rope_type = params.get(
            "rope_type", scaling.get("rope_type", scaling.get("type", "default"))
        )
        if rope_type != "default":
            raise self.error(f"rope_type={rope_type!r} is not supported (baton runs 'default')")
        theta = params.get("rope_theta", self.hf.get("rope_theta"))
        if theta is None:
            theta = self.rope_defaults.get("rope_theta")
        if theta is None:
            raise self.error("missing required key 'rope_parameters' (its 'rope_theta')")
        factor = params.get("partial_rotary_factor", self.hf.get("partial_rotary_factor"))
        if factor is None or not partial:
            factor = self.rope_defaults.get("partial_rotary_factor", 1.0) if partial else 1.0
        rotary = RotaryConfig(dim=int(head_dim * factor), theta=float(theta))
        if not 0 < rotary.num_rotated <= head_dim:
            raise self.error(
                f"partial_rotary_factor={factor} rotates {rotary.num_rotated} channels of "
                f"head_dim {head_dim} (rotary dim {rotary.dim}); it must rotate 1..head_dim"
            )
        return rotary


@dataclass(frozen=True, kw_only=True, slots=True)
class RotaryConfig:
    """NeoX-style rotary embeddings on the first channels of each head (partial rotary when
    dim < head_dim), frequencies theta ** -(2i / dim) for even 2i < dim. Like transformers,
    an odd `dim` (int(head_dim * partial_rotary_factor)) gets dim // 2 + 1 frequencies and so
    rotates dim + 1 channels."""

    dim: int
    theta: float

    @property
    def num_rotated(self) -> int:
        return 2 * -(-self.dim // 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """What every family has. The engine reads these and nothing of `family`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Multi-token-prediction layers stored in the checkpoint (`mtp.*`); an engine that does not
    # draft with them serves `without_mtp()`: no MTP head, no MTP state, weights skipped.
    num_nextn_predict_layers: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    # The family's own config (a frozen dataclass of its family file: layers, multipliers).
    family: Any

    def with_mtp(self, use: bool) -> ModelConfig:
        """This config with its MTP layers kept only when speculation drafts with them."""
        return self if use else dataclasses.replace(self, num_nextn_predict_layers=0)

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{model_dir}: no config.json (expected a Hugging Face model directory)"
            )
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        from baton.engine.models.registry import family_for

        family = family_for(raw, source)
        reader = ConfigReader(raw, source, *family.hf_config_defaults())
        return family.read_config(reader)
