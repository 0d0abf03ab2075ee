"""What one tensor-parallel rank of a model holds: the Mamba2 mixer's slices of the checkpoint,
the shapes of its pools, and the check that refuses, before any process starts, a model and
TP size that cannot be served.

The Mamba2 mixer's in_proj rows and conv channels are segments with different split rules
(vLLM's mamba_v2_sharded_weight_loader follows the same layout):

    in_proj rows:   z (I) | x (I) | B (G*N) | C (G*N) | dt (H)     I = H * head_dim
    conv channels:          x (I) | B (G*N) | C (G*N)

z, x, dt and the conv's x channels follow the heads; B and C follow the groups: split when
n_groups divides by the size, replicated whole on every rank when n_groups == 1 (then the
gated norm's single group spans the ranks and its variance is all-reduced).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import parallel
from engine.config import ConfigError, ModelConfig
from engine.parallel import TensorParallel

# Families whose every layer knows its shard (the others refuse TP > 1 at startup).
TP_ARCHITECTURES = ("NemotronHForCausalLM",)

Ranges = tuple[tuple[int, int], ...]  # (start, length) along one dim of the full tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaShard:
    first_head: int
    num_heads: int
    first_group: int
    num_groups: int
    norm_across_ranks: bool  # one group replicated on every rank: the norm all-reduces
    in_proj_rows: Ranges  # z | x | B | C | dt, in that order
    conv_channels: Ranges  # x | B | C


def mamba_shard(config: ModelConfig, tp: TensorParallel) -> MambaShard:
    head_dim, d_state = config.mamba_head_dim, config.ssm_state_size
    inter, gn = config.mamba_intermediate, config.n_groups * config.ssm_state_size
    h0, heads = parallel.split_evenly(config.mamba_num_heads, tp, "mamba_num_heads")
    g0, groups = parallel.mamba_group_part(config.n_groups, tp)
    x = (h0 * head_dim, heads * head_dim)
    b = (g0 * d_state, groups * d_state)
    c = (gn + g0 * d_state, groups * d_state)
    return MambaShard(
        first_head=h0,
        num_heads=heads,
        first_group=g0,
        num_groups=groups,
        norm_across_ranks=tp.size > 1 and config.n_groups == 1 and config.mamba_norm != "none",
        in_proj_rows=(
            x,
            (inter + x[0], x[1]),
            (2 * inter + b[0], b[1]),
            (2 * inter + c[0], c[1]),
            (2 * inter + 2 * gn + h0, heads),
        ),
        conv_channels=(x, (inter + b[0], b[1]), (inter + c[0], c[1])),
    )


def check_tp_supported(config: ModelConfig, size: int) -> None:
    """Raise ConfigError naming the numbers when this model cannot run on `size` ranks."""
    if size < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return
    if config.architecture not in TP_ARCHITECTURES:
        raise ConfigError(
            f"{config.architecture} does not support tensor parallelism yet "
            f"(--tensor-parallel-size {size}); supported: {', '.join(TP_ARCHITECTURES)}"
        )
    # Every rank's view, built with a group-less TensorParallel: each rule raises its own error.
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    if config.mamba_layer_ids:
        mamba_shard(config, probe)
    if config.attention_layer_ids:
        parallel.split_evenly(config.num_attention_heads, probe, "num_attention_heads")
        parallel.kv_head_part(config.num_key_value_heads, config.num_attention_heads, probe)
    if "mlp" in config.layer_types:
        parallel.split_evenly(config.intermediate_size, probe, "intermediate_size")
    if config.moe is not None:
        parallel.split_evenly(config.moe.intermediate_size, probe, "moe_intermediate_size")
        parallel.split_evenly(
            config.moe.shared_intermediate_size, probe, "moe_shared_expert_intermediate_size"
        )


def pool_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config whose KV and Mamba shapes are this rank's shard (for StateCache only)."""
    if tp.size == 1:
        return config
    changes = {}
    if config.attention_layer_ids:
        _, kv_heads = parallel.kv_head_part(
            config.num_key_value_heads, config.num_attention_heads, tp
        )
        changes["num_key_value_heads"] = kv_heads
    if config.mamba_layer_ids:
        mamba = mamba_shard(config, tp)
        changes.update(mamba_num_heads=mamba.num_heads, n_groups=mamba.num_groups)
    return dataclasses.replace(config, **changes)
