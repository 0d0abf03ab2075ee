"""The file tier's file format (engine/cache/tier_files.py writes and reads the files):

    magic "BATONTR1" | u32 version | u32 header bytes | u64 payload bytes | 32-byte blake2b of
    (header + payload) | header (JSON: identity, digest, tokens, live pages, tensor table) |
    payload (the record's tensors, in the layout's order, raw)

`decode` trusts nothing it reads: the sizes, then the checksum, then every header field by type
and value against what this engine would have written for that block. A sound file of another
identity (model, weights, dtype, layout, format) is ForeignFile; anything else wrong is CorruptFile.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from baton.engine.cache.tier_records import (
    FORMAT_VERSION,
    BlockRecord,
    TierIdentity,
    TierLayout,
    TierTensor,
)

MAGIC = b"BATONTR1"
PREFIX = struct.Struct("<8sIIQ32s")  # magic, version, header bytes, payload bytes, checksum
MAX_HEADER_BYTES = 1 << 20


class ForeignFile(ValueError):
    """A sound file of another model, dtype or layout: not ours to load or delete."""


class CorruptFile(ValueError):
    """Truncated, damaged or inconsistent: never loaded, deleted."""


def _offsets(layout: TierLayout) -> list[tuple[TierTensor, int]]:
    out, offset = [], 0
    for t in layout.tensors:
        out.append((t, offset))
        offset += t.nbytes
    return out


def _header(raw: bytes) -> dict:
    """The header's fields, each of the type it must have; CorruptFile for anything else."""
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise CorruptFile(f"unreadable header ({error})") from None
    types = {
        "identity": str, "description": str, "digest": str, "tokens": list,
        "live_pages": list, "tensors": list,
    }  # fmt: skip
    if not isinstance(header, dict) or any(
        not isinstance(header.get(key), kind) for key, kind in types.items()
    ):
        raise CorruptFile("header fields missing or of the wrong type")
    if not all(isinstance(x, bool) for x in header["live_pages"]):
        raise CorruptFile("page flags are not booleans")
    return header


def encode_parts(record: BlockRecord, identity: TierIdentity, layout: TierLayout) -> list:
    """The file as consecutive buffers (prefix, header, then each tensor's bytes as a view of
    the record's own memory: a block is not copied to be hashed and written)."""
    entries = [{"key": t.key, "offset": o, "bytes": t.nbytes} for t, o in _offsets(layout)]
    header = json.dumps(
        {
            "identity": identity.fingerprint,
            "description": identity.description,
            "digest": record.digest.hex(),
            "tokens": list(record.tokens),
            "live_pages": list(record.live_pages),
            "tensors": entries,
        }
    ).encode()
    payload = [
        memoryview(record.tensors[t.key].contiguous().view(torch.uint8).numpy()).cast("B")
        for t in layout.tensors
    ]
    hasher = hashlib.blake2b(header, digest_size=32)
    for part in payload:
        hasher.update(part)
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), layout.nbytes, hasher.digest())
    return [prefix, header, *payload]


def encode(record: BlockRecord, identity: TierIdentity, layout: TierLayout) -> bytes:
    return b"".join(encode_parts(record, identity, layout))


def decode(
    data: bytes | bytearray,
    identity: TierIdentity,
    layout: TierLayout,
    digest: bytes,
    tokens: tuple[int, ...],
) -> BlockRecord:
    """The record in `data` if it is sound and the one asked for; ForeignFile / CorruptFile.
    The record's tensors are views of `data` (copied first when it is immutable bytes)."""
    if len(data) < PREFIX.size:
        raise CorruptFile(f"{len(data)} bytes, shorter than the file prefix")
    magic, version, header_len, payload_len, checksum = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptFile("not a baton tier file (bad magic)")
    if version != FORMAT_VERSION:
        raise ForeignFile(f"format version {version}, this server writes {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or len(data) != PREFIX.size + header_len + payload_len:
        raise CorruptFile(
            f"{len(data)} bytes, the prefix says {PREFIX.size} + {header_len} + {payload_len}"
        )
    body = memoryview(data)[PREFIX.size :]
    if hashlib.blake2b(body, digest_size=32).digest() != checksum:
        raise CorruptFile("checksum mismatch")
    header = _header(bytes(body[:header_len]))
    if header["identity"] != identity.fingerprint:
        raise ForeignFile(f"written for {header['description']!r}")
    if header["digest"] != digest.hex() or header["tokens"] != list(tokens):
        raise CorruptFile("digest or tokens are not the block's the name says")
    live = tuple(header["live_pages"])
    if len(live) != layout.pages_per_block:
        raise CorruptFile(f"{len(live)} page flags, a block has {layout.pages_per_block} pages")
    expected = [{"key": t.key, "offset": o, "bytes": t.nbytes} for t, o in _offsets(layout)]
    if header["tensors"] != expected or sum(t.nbytes for t in layout.tensors) != payload_len:
        raise CorruptFile("tensor layout differs from this model's")
    if isinstance(data, bytes):
        data = bytearray(data)  # writable: the tensors own it
    tensors = {}
    for t, offset in _offsets(layout):
        at = PREFIX.size + header_len + offset
        flat = torch.frombuffer(data, dtype=torch.uint8, count=t.nbytes, offset=at)
        tensors[t.key] = flat.view(t.dtype).view(t.shape)
    return BlockRecord(digest=digest, tokens=tokens, live_pages=live, tensors=tensors)
