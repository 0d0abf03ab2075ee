"""Which rank holds which slice of a request's state, on either side of a handover between
engines of different tensor-parallel sizes, and which prefill rank sends each decode rank what:
all derived from the model's state spec (engine/cache/spec.py).

Every state tensor is split along one dim of "units" (its spec's TPSplit: KV heads, conv
channels in x | B | C segments, Mamba heads, ...; SGLang's heterogeneous-TP transfer and vLLM's
nixl connector cut the same way), and travels as components:

    pages/<pool>        (layers, pages, page_size, *shape)   the prompt's pages
    slots/<pool>        (layers, *shape)                     the final slot state
    checkpoints/<pool>  (blocks, layers, *shape)             the prompt's prefix-cache blocks
                                                             (checkpointed tensors only)

A rank owns a list of (start, length) ranges of a component's whole-model units; its local
tensor holds them concatenated in that order. A decode rank's `plan` takes each of its units from
the lowest prefill rank that holds it, so a replicated unit crosses the wire once per decode rank
that owns it and every decode rank receives exactly what it owns, no more.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from baton.engine.cache.spec import ModelStateSpec, Ranges
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.parallel.support import check_tp_supported

# A peer may claim any size; these bound what one claim can make this side compute or connect.
MAX_TP_SIZE = 256

# A decode rank's receive address: tcp://host:port (a name, IPv4, or [IPv6]).
ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):[0-9]{1,5}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TPLayout:
    """One side's tensor-parallel layout, as it travels in a Register: its size and, for a decode
    worker, where each rank receives its shard (rank order)."""

    size: int
    rank_addresses: list[str]

    def describe(self) -> str:
        return f"TP={self.size}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Units [dst_offset, dst_offset + length) of a decode rank's local `component` tensor come
    from units [src_offset, src_offset + length) of prefill rank `source`'s local tensor."""

    component: str
    source: int
    src_offset: int
    dst_offset: int
    length: int

    @property
    def name(self) -> str:
        """The frame's name on the wire."""
        return f"{self.component}@{self.dst_offset}"


@functools.cache
def owned(spec: ModelStateSpec, size: int, rank: int) -> dict[str, Ranges]:
    """Component -> the whole-model unit ranges rank `rank` of `size` holds, in local order."""
    out: dict[str, Ranges] = {}
    covered = spec.covered_pools()  # moved by the pool whose memory holds them
    for name, _, tensor in spec.entries():
        if name in covered:
            continue
        ranges = tensor.ranges(size, rank)
        if tensor.kind == "paged":
            out[f"pages/{name}"] = ranges
        else:
            out[f"slots/{name}"] = ranges
            if tensor.checkpointed:
                out[f"checkpoints/{name}"] = ranges
    return out


def _local(ranges: Ranges, unit: int) -> int | None:
    """Where global `unit` sits in the local tensor of a rank holding `ranges` (None: absent)."""
    offset = 0
    for start, length in ranges:
        if start <= unit < start + length:
            return offset + unit - start
        offset += length
    return None


@functools.cache
def plan(spec: ModelStateSpec, prefill_size: int, decode_size: int, rank: int) -> tuple[Piece, ...]:
    """The pieces decode rank `rank` receives, each unit from the lowest prefill rank holding
    it, runs of consecutive units from one source merged into one piece."""
    sources = [owned(spec, prefill_size, p) for p in range(prefill_size)]
    pieces: list[Piece] = []
    for component, ranges in owned(spec, decode_size, rank).items():
        dst = 0
        for start, length in ranges:
            for unit in range(start, start + length):
                source, src = next(
                    (p, at)
                    for p, held in enumerate(sources)
                    if (at := _local(held[component], unit)) is not None
                )
                last = pieces[-1] if pieces else None
                if (
                    last is not None
                    and last.component == component
                    and last.source == source
                    and last.src_offset + last.length == src
                    and last.dst_offset + last.length == dst
                ):
                    pieces[-1] = Piece(
                        component=component,
                        source=source,
                        src_offset=last.src_offset,
                        dst_offset=last.dst_offset,
                        length=last.length + 1,
                    )
                else:
                    pieces.append(
                        Piece(
                            component=component,
                            source=source,
                            src_offset=src,
                            dst_offset=dst,
                            length=1,
                        )
                    )
                dst += 1
    return tuple(pieces)


def piece_segments(
    spec: ModelStateSpec,
    name: str,
    prefill_size: int,
    source: int,
    decode_size: int,
    rank: int,
    piece: Piece,
) -> list[tuple[int, int, int]]:
    """(offset in a decode row, offset in a prefill row, bytes) of each run of `piece`'s units
    within one row: the units are one index of the split dim, so a row holds them as `outer`
    runs (the dims before it) of `length x inner` bytes (the dims after it)."""
    _, tensor = spec.tensor(name)
    dim = tensor.unit_dim
    src = list(tensor.local_shape(prefill_size, source)) or [1]
    dst = list(tensor.local_shape(decode_size, rank)) or [1]
    if src[:dim] + src[dim + 1 :] != dst[:dim] + dst[dim + 1 :]:
        raise ValueError(f"pool {name}: prefill rank rows {src} and decode rank rows {dst} differ")
    inner = math.prod(src[dim + 1 :]) * tensor.dtype.itemsize
    outer = math.prod(src[:dim])
    return [
        (
            o * dst[dim] * inner + piece.dst_offset * inner,
            o * src[dim] * inner + piece.src_offset * inner,
            piece.length * inner,
        )
        for o in range(outer)
    ]


def planned_bytes(
    spec: ModelStateSpec, decode_size: int, *, tokens: int, states: int, blocks: int
) -> int:
    """What the decode ranks of `decode_size` take in all (each exactly what it owns) of
    `tokens` page rows, `states` final slot states and `blocks` block checkpoints."""
    total = 0
    for rank in range(decode_size):
        for component, ranges in owned(spec, decode_size, rank).items():
            field, name = component.split("/", 1)
            group, tensor = spec.tensor(name)
            unit_bytes = tensor.bytes() // max(1, (tensor.shape or (1,))[tensor.unit_dim])
            count = {"pages": tokens, "slots": states, "checkpoints": blocks}[field]
            total += sum(n for _, n in ranges) * unit_bytes * group.num_layers * count
    return total


def check_size(config: ModelConfig, spec: ModelStateSpec, size: int) -> None:
    """ConfigError naming the key when this model (its family, its layers' state) cannot run
    on `size` ranks."""
    check_tp_supported(config, size)
    spec.check_tp(size)


def check_prefill_size(config: ModelConfig, spec: ModelStateSpec, size: int) -> None:
    """ValueError unless a prefill engine of `size` ranks could serve this model (a peer's
    claim, before any plan is made from it)."""
    if not 1 <= size <= MAX_TP_SIZE:
        raise ValueError(f"prefill worker claims TP={size}: a TP size must be in 1..{MAX_TP_SIZE}")
    try:
        check_size(config, spec, size)
    except ConfigError as error:
        raise ValueError(
            f"prefill worker claims TP={size}, which this model cannot have: {error}"
        ) from None


def refusal(
    config: ModelConfig, spec: ModelStateSpec, prefill_size: int, decode: TPLayout
) -> str | None:
    """Why a prefill engine of `prefill_size` ranks cannot hand over to the decode layout a peer
    claims (a message naming both layouts), or None. The claim is hostile until this passes."""
    both = f"prefill worker TP={prefill_size}, decode worker TP={decode.size}"
    if not 1 <= decode.size <= MAX_TP_SIZE:
        return f"cannot serve this pair ({both}): a TP size must be in 1..{MAX_TP_SIZE}"
    if len(decode.rank_addresses) != decode.size:
        return (
            f"cannot serve this pair ({both}): the decode worker lists"
            f" {len(decode.rank_addresses)} rank addresses for {decode.size} ranks"
        )
    sharded = prefill_size > 1 or decode.size > 1  # (1 and 1: the whole-state handover)
    for rank, address in enumerate(decode.rank_addresses if sharded else ()):
        if not ENDPOINT.fullmatch(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
            return (
                f"cannot serve this pair ({both}): decode rank {rank} gives no tcp://host:port"
                f" address to receive its shard at ({address[:80]!r}; was it started without"
                " a handover connector?)"
            )
    try:
        check_size(config, spec, decode.size)
    except ConfigError as error:
        return f"cannot serve this pair ({both}): {error}"
    return None
