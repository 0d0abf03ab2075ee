"""What a tier below the device pools keeps of one evicted prefix-cache block, and how it is named.

BlockRecord  one block (engine/cache/prefix_cache.py): its own KV pages of every paged
             tensor and its checkpoint slot's state of every checkpointed slot tensor,
             copied out of the pools; its tokens guard against digest collisions
TierLayout   what a record of this engine holds, tensor by tensor (derived from the pools,
             i.e. from the state spec): a file is loaded only if it matches exactly
TierIdentity the model, weights, dtype, page size, track interval and state layout the
             records belong to; its fingerprint seeds every digest and heads every file
chain_digests stable block keys: blake2b over the identity and the chain of token ids
             (Python's `hash` keys of the device cache are not meant to outlive a process)

pages:<pool>       (layers, pages_per_block, page_size, *one token's shape)   paged tensors
checkpoint:<pool>  (layers, *one slot's shape)                                checkpointed
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.cache.pools import StateCache

DIGEST_BYTES = 16
FORMAT_VERSION = 1  # of records and files; part of the identity (a new format: new names)


@dataclass(frozen=True, kw_only=True, slots=True)
class TierTensor:
    key: str  # "pages:<pool name>" or "checkpoint:<pool name>"
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, kw_only=True, slots=True)
class TierLayout:
    pages_per_block: int  # 0 when the model keeps no paged state
    tensors: tuple[TierTensor, ...]

    @classmethod
    def of(cls, cache: StateCache, pages_per_block: int) -> TierLayout:
        """A block's record in `cache`'s pools: its pages of every paged pool, its checkpoint of
        every checkpointed slot pool (the state spec's order)."""
        ppb = pages_per_block if cache.paged else 0
        tensors = []
        for name in cache.paged:
            pool = cache.page_view(name)  # (layers, num_pages, page_size, *shape)
            shape = (pool.shape[0], ppb, *pool.shape[2:])
            tensors.append(TierTensor(key=f"pages:{name}", dtype=pool.dtype, shape=shape))
        for name in cache.slotted:
            if name in cache.checkpointed:
                pool = cache.pools[name]  # (layers, num_slots, *shape)
                shape = (pool.shape[0], *pool.shape[2:])
                tensors.append(TierTensor(key=f"checkpoint:{name}", dtype=pool.dtype, shape=shape))
        return cls(pages_per_block=ppb, tensors=tuple(tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> list[str]:
        return [
            f"{t.key} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.tensors
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class TierIdentity:
    fingerprint: str  # hex; seeds the digests, heads every file
    description: str  # what it was computed from, for the log line that ignores a file

    @classmethod
    def of(
        cls,
        *,
        config_fingerprint: str,
        weights_fingerprint: str,
        dtype: torch.dtype,
        page_size: int,
        track_interval: int,
        layout: TierLayout,
    ) -> TierIdentity:
        description = "; ".join(
            [
                f"format {FORMAT_VERSION}",
                f"config {config_fingerprint}",
                f"weights {weights_fingerprint}",
                f"dtype {str(dtype).removeprefix('torch.')}",
                f"page size {page_size}",
                f"track interval {track_interval}",
                *layout.describe(),
            ]
        )
        fingerprint = hashlib.blake2b(description.encode(), digest_size=16).hexdigest()
        return cls(fingerprint=fingerprint, description=description)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockRecord:
    digest: bytes  # chain_digests' entry for this block
    tokens: tuple[int, ...]  # the block's own tokens
    # False where the block held the dummy page 0 (a page released behind a sliding window:
    # nothing reads it, and it is restored as the dummy page again)
    live_pages: tuple[bool, ...]
    tensors: dict[str, torch.Tensor]  # TierTensor.key -> tensor of its shape, on the CPU

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def chain_digests(
    seed: str, token_ids: Sequence[int], interval: int, num_blocks: int
) -> list[bytes]:
    """digest_k = blake2b(digest_{k-1} || block k's token ids as little-endian int64), digest_-1 =
    the identity's fingerprint: equal chains of equal models get equal names in any process."""
    out, prev = [], bytes.fromhex(seed)
    for k in range(num_blocks):
        tokens = np.asarray(token_ids[k * interval : (k + 1) * interval], dtype="<i8")
        prev = hashlib.blake2b(prev + tokens.tobytes(), digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out
