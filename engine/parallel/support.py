"""Whether a model can run on a tensor-parallel size: its family's own check (a capability each
family module declares, `check_tp`, from the layers it is built of: each layer knows how its
weights and its state split), refused for families that declare none."""

from __future__ import annotations

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError


def check_tp_supported(config: ModelConfig, size: int) -> None:
    """Raise ConfigError naming the numbers when this model cannot run on `size` ranks."""
    from baton.engine.models.registry import family_named, tp_architectures

    if size < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return
    check = family_named(config.architecture).check_tp
    if check is None:
        raise ConfigError(
            f"{config.architecture} does not support tensor parallelism yet "
            f"(--tensor-parallel-size {size}); supported: {', '.join(tp_architectures())}"
        )
    check(config, size)
