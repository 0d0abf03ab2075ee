"""Wire protocol between a prefill engine and a decode engine.

Every message is a multipart ZMQ message:

    [ header (msgpack map) | mac (32 bytes, HMAC-SHA256 of all other frames, or empty) | tensor frames... ]

Headers have explicit schemas: `decode_header` checks the type tag and every field's type and
rejects anything else (a pickle payload is just bytes that do not parse as a msgpack map with a
known tag). Tensors travel as raw frames, described in the header by dtype and shape.

Room state machine (both sides):

    bootstrapping --register ok--> waiting_for_input --prefill done--> transferring --> success
          |                               |                                 |
          +---------- timeout / abort / reject / peer lost -----------------+--> failed
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import torch

# 2: K/V and Mamba chunks carry one frame per layer. 3: Register carries the decode side's
# transfer timeout (the prefill side keeps zero-copy sends' pages no longer than that).
PROTOCOL_VERSION = 3


class ProtocolError(ValueError):
    """A message that does not parse, has the wrong schema, or fails authentication."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Compat:
    """What must match between the two engines for a handover to be meaningful."""

    model: str  # fingerprint of the model config
    dtype: str
    page_size: int
    kv_page_shape: list[int]  # (attention_layers, page_size, kv_heads, head_dim)
    conv_shape: list[int]  # (mamba_layers, conv_dim, K-1)
    ssm_shape: list[int]  # (mamba_layers, heads, head_dim, d_state)
    ssm_dtype: str

    def mismatch(self, other: Compat) -> str | None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return (
                    f"{f.name} differs: prefill worker has {mine!r}, decode worker has {theirs!r}"
                )
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Register:
    """decode -> prefill: pages and a slot are reserved for this room; send the state here."""

    tag: ClassVar[str] = "register"
    room: str
    compat: Compat
    num_prompt_tokens: int
    cached_tokens: int  # leading prompt tokens the decode engine caches itself: not sent
    track_interval: int  # decode engine's prefix-cache block size (0: no cache)
    # The decode engine ignores this room's state once this long has passed since it registered
    # (so the prefill engine may reuse pages that its sends for the room still read).
    transfer_timeout_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Reject:
    """prefill -> decode: this room cannot be served (incompatible, unknown, failed)."""

    tag: ClassVar[str] = "reject"
    room: str
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Abort:
    """either direction: forget this room."""

    tag: ClassVar[str] = "abort"
    room: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """decode -> prefill: these rooms are still wanted (keeps their lease alive)."""

    tag: ClassVar[str] = "heartbeat"
    rooms: list[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class HeartbeatAck:
    """prefill -> decode: of the rooms asked about, these are unknown here (lost)."""

    tag: ClassVar[str] = "heartbeat_ack"
    unknown_rooms: list[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTransfer:
    """prefill -> decode: the prompt's K/V pages, final Mamba state and first token. The tensor
    frames follow the header in `tensors` order."""

    tag: ClassVar[str] = "state"
    room: str
    num_prompt_tokens: int
    first_page: int  # k/v pages start at this page of the prompt
    first_block: int  # checkpoints start at this prefix-cache block
    first_token: int
    first_logprobs: dict[int, float] | None
    tensors: list[TensorSpec] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class KVChunk:
    """prefill -> decode: K/V pages completed by a prefill chunk, sent while the prompt's later
    chunks still compute (frames: k of each attention layer, then v of each, every one
    (n, page, kv_heads, head_dim); on a CPU pool they are sent straight from it)."""

    tag: ClassVar[str] = "kv"
    room: str
    first_page: int
    tensors: list[TensorSpec] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaChunk:
    """prefill -> decode: the final conv + SSM state of Mamba layers first_layer.. (frames: conv
    (conv_dim, K-1) of each layer, then ssm (heads, head_dim, d_state) of each), pushed ahead of
    the StateTransfer so the decode side installs one group while the next is on the wire. A
    StateTransfer whose conv/ssm carry no layers means all of them came this way."""

    tag: ClassVar[str] = "mamba"
    room: str
    first_layer: int
    tensors: list[TensorSpec] = field(default_factory=list)


MESSAGES = {
    cls.tag: cls
    for cls in (
        Register,
        Reject,
        Abort,
        Heartbeat,
        HeartbeatAck,
        StateTransfer,
        KVChunk,
        MambaChunk,
    )
}
Message = Register | Reject | Abort | Heartbeat | HeartbeatAck | StateTransfer | KVChunk
WITH_TENSORS = (StateTransfer, KVChunk, MambaChunk)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The header's description of each (name, tensor) frame."""
    return [TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in named]


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _plain(value: Any) -> dict:
    """msgpack's hook for the message dataclasses (msgpack itself recurses into the fields)."""
    if not hasattr(value, "__dataclass_fields__"):
        raise TypeError(f"cannot encode {type(value).__name__}")
    return {name: getattr(value, name) for name in _field_names(type(value))}


def _check(cls, raw: Any, where: str):
    """Build dataclass `cls` from a msgpack map, checking that the keys match exactly."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    names = _field_names(cls)
    if set(raw) != set(names):
        raise ProtocolError(f"{where}: fields {sorted(raw)} do not match {sorted(names)}")
    return raw


def _parse(tag: str, raw: dict) -> Message:
    cls = MESSAGES[tag]
    body = dict(_check(cls, raw, tag))
    if cls is Register:
        body["compat"] = Compat(**_check(Compat, body["compat"], "register.compat"))
    if cls in WITH_TENSORS:
        body["tensors"] = [
            TensorSpec(**_check(TensorSpec, t, f"{tag}.tensors")) for t in body["tensors"]
        ]
    if cls is StateTransfer:
        if body["first_logprobs"] is not None:
            body["first_logprobs"] = {int(k): float(v) for k, v in body["first_logprobs"].items()}
    try:
        message = cls(**body)
    except TypeError as error:
        raise ProtocolError(f"{tag}: {error}") from None
    for f in fields(cls):
        value = getattr(message, f.name)
        if f.type in ("str", "int") and not isinstance(value, {"str": str, "int": int}[f.type]):
            raise ProtocolError(f"{tag}.{f.name}: expected {f.type}, got {type(value).__name__}")
    return message


def _frame(t: torch.Tensor) -> memoryview | bytes:
    """A tensor's bytes without a copy on the host; a GPU tensor is first copied down once."""
    if not t.numel():
        return b""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.cpu().contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def encode(
    message: Message, tensors: list[torch.Tensor] = (), secret: bytes | None = None
) -> list[Any]:
    """Frames for `send_multipart(copy=False)`: header, mac, then the raw tensor bytes."""
    header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "type": message.tag, "body": message}, default=_plain
    )
    payload = [_frame(t) for t in tensors]
    return [header, _mac(secret, [header, *payload]), *payload]


def decode(frames: list[bytes], secret: bytes | None = None) -> tuple[Message, list[torch.Tensor]]:
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    header, mac, payload = bytes(frames[0]), bytes(frames[1]), frames[2:]
    if secret is not None and not hmac.compare_digest(mac, _mac(secret, [header, *payload])):
        raise ProtocolError("message authentication failed (wrong or missing --disagg-secret)")
    try:
        raw = msgpack.unpackb(header, raw=False, strict_map_key=False)
    except Exception as error:
        raise ProtocolError(f"header is not msgpack: {error}") from None
    if not isinstance(raw, dict) or raw.get("type") not in MESSAGES:
        raise ProtocolError("header is not a baton disaggregation message")
    if raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks disaggregation protocol {raw.get('v')!r}, this worker {PROTOCOL_VERSION}"
            " (run the same baton version on both sides)"
        )
    message = _parse(raw["type"], raw.get("body"))
    tensors = []
    if isinstance(message, WITH_TENSORS):
        if len(payload) != len(message.tensors):
            raise ProtocolError(
                f"state: {len(message.tensors)} tensors announced, {len(payload)} frames sent"
            )
        for spec, frame in zip(message.tensors, payload):
            if spec.dtype not in _DTYPES:
                raise ProtocolError(f"state: unsupported dtype {spec.dtype!r}")
            tensor = _view(frame, _DTYPES[spec.dtype])
            if tensor.numel() != _numel(spec.shape):
                raise ProtocolError(
                    f"state: tensor {spec.name} has {tensor.numel()} elements, header says {spec.shape}"
                )
            tensors.append(tensor.view(spec.shape))
    return message, tensors


# Received frames are read-only, and the tensors over them are only ever copied from (into the
# pools). torch warns about such tensors: one filter here, not a catch_warnings per frame.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _view(frame, dtype: torch.dtype) -> torch.Tensor:
    """A read-only tensor over the received frame, no copy (the receiver copies it into its
    pools anyway, and the tensor keeps the frame alive)."""
    if not len(frame):
        return torch.empty(0, dtype=dtype)
    if len(frame) % dtype.itemsize:
        raise ProtocolError(f"frame of {len(frame)} bytes is not a whole number of {dtype} values")
    return torch.frombuffer(frame, dtype=dtype)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _mac(secret: bytes | None, frames: list) -> bytes:
    if secret is None:
        return b""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little") if hasattr(frame, "__len__") else b"")
        mac.update(frame)
    return mac.digest()
