"""The tensors that hold per-request state: paged K/V for attention layers and the Mamba pool.

    KV (per attention layer):  k, v  (num_pages * page_size, kv_heads, head_dim)   model dtype
                               token slot = page * page_size + offset; page 0 = dummy page
    Mamba (layer-major):       conv  (mamba_layers, num_slots, conv_dim, K-1)       model dtype
                               ssm   (mamba_layers, num_slots, heads, head_dim, d_state)
                                                                      mamba_ssm_cache_dtype (fp32)
                               slot 0 = dummy slot that padded rows read and write

Layer-major means one (layer, slot) is one contiguous block, so copying a slot (checkpoints,
transfers) is a plain strided copy.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class StateCache:
    def __init__(
        self,
        config: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        num_mamba_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_mamba_slots = num_mamba_slots
        num_tokens = num_pages * page_size
        kv_shape = (num_tokens, config.num_key_value_heads, config.head_dim)
        self.k = [
            torch.zeros(kv_shape, dtype=dtype, device=device) for _ in config.attention_layer_ids
        ]
        self.v = [
            torch.zeros(kv_shape, dtype=dtype, device=device) for _ in config.attention_layer_ids
        ]
        num_mamba = len(config.mamba_layer_ids)
        self.conv = torch.zeros(
            (num_mamba, num_mamba_slots, config.conv_dim, config.conv_kernel - 1),
            dtype=dtype,
            device=device,
        )
        ssm_dtype = getattr(torch, config.mamba_ssm_cache_dtype)
        self.ssm = torch.zeros(
            (
                num_mamba,
                num_mamba_slots,
                config.mamba_num_heads,
                config.mamba_head_dim,
                config.ssm_state_size,
            ),
            dtype=ssm_dtype,
            device=device,
        )

    def kv_layer(self, attention_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[attention_index], self.v[attention_index]

    def mamba_layer(self, mamba_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[mamba_index], self.ssm[mamba_index]

    def reset_mamba_slot(self, slot: int) -> None:
        """A fresh request starts from zero conv and SSM state."""
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def copy_mamba_slot(self, src: int, dst: int) -> None:
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])

    @staticmethod
    def bytes_per_kv_token(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (
            2
            * len(config.attention_layer_ids)
            * config.num_key_value_heads
            * config.head_dim
            * itemsize
        )

    @staticmethod
    def bytes_per_mamba_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        ssm_itemsize = torch.empty(
            (), dtype=getattr(torch, config.mamba_ssm_cache_dtype)
        ).element_size()
        per_layer = config.conv_dim * (config.conv_kernel - 1) * itemsize + (
            config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * ssm_itemsize
        )
        return len(config.mamba_layer_ids) * per_layer
