"""Wire protocol between a prefill engine and a decode engine.

Every message is a multipart ZMQ message:

    [ header (msgpack map) | mac (32 bytes, HMAC-SHA256 of all other frames, or empty) | tensor frames... ]

Headers are the messages' dataclasses, their wire form derived from the fields (disagg.schema):
`decode` checks the type tag and every field against its annotation, nested ones included, and
rejects anything else (a pickle payload is just bytes that do not parse as a msgpack map with a
known tag). Tensors travel as raw frames, each described in the header by name, dtype and shape,
and are handed on by name, never by position. The request state itself (engine.handover's
RequestState) is never listed here: a StateTransfer carries its non-tensor fields in `state` and
its tensor fields as frames named after them, both derived from the dataclass.

Room state machine (both sides):

    bootstrapping --register ok--> waiting_for_input --prefill done--> transferring --> success
          |                               |                                 |
          +---------- timeout / abort / reject / peer lost -----------------+--> failed
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
import typing
import warnings
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack
import torch

from disagg.schema import (
    ProtocolError,
    from_wire,
    header_fields,
    header_from_wire,
    tensor_fields,
    to_wire,
)
from disagg.tp_layout import TPLayout
from engine.handover import RequestState

# 2: K/V and Mamba chunks carry one frame per layer. 3: Register carries the decode side's
# transfer timeout (the prefill side keeps zero-copy sends' pages no longer than that).
# 4: StateTransfer carries RequestState's fields as derived from the dataclass, tensors by name.
# 5: the header holds a timestamp and a nonce (under the MAC): replays are refused.
# 6: Register carries the decode side's TP layout, StateTransfer the prefill side's TP size;
# ShardTransfer moves a rank's slices straight between ranks (disagg/tp_transfer.py). Compat
# compares the whole model's shapes (each side's ranks hold slices of them).
# 7: ShardTransfer carries the prompt's block checkpoints (from `first_block`), sliced like the
# final conv / SSM state.
PROTOCOL_VERSION = 7

# With a secret, a message is accepted within this many seconds of the time it was sent (two
# hosts need clocks within this of each other, e.g. NTP), and only once.
REPLAY_WINDOW_S = 60.0
NONCE_BYTES = 16

# What a StateTransfer carries (a module attribute, so a test can carry an extended state).
STATE_CARRIER: type = RequestState


@dataclass(frozen=True, kw_only=True, slots=True)
class Compat:
    """What must match between the two engines for a handover to be meaningful."""

    model: str  # fingerprint of the model config
    dtype: str
    page_size: int
    # the whole model's (TP=1) shapes, whatever either side's TP size
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
    tp: TPLayout  # the decode engine's ranks and where each receives its shard


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
    """prefill -> decode: a RequestState (the prompt's remaining K/V pages, final Mamba state,
    first token, block checkpoints). Build it with `state_message`, read it with
    `request_state`."""

    tag: ClassVar[str] = "state"
    carries: ClassVar[str] = "state"  # the field holding STATE_CARRIER's non-tensor fields
    room: str
    # The prefill engine's TP size. When either side's is > 1 the K/V pages and Mamba state
    # came rank to rank as ShardTransfers and the tensors here hold no pages and no layers.
    tp_size: int
    state: dict[str, object]  # checked against STATE_CARRIER's annotations by `decode`
    tensors: list[TensorSpec]  # STATE_CARRIER's tensor fields, one frame each, named after them


@dataclass(frozen=True, kw_only=True, slots=True)
class KVChunk:
    """prefill -> decode: K/V pages completed by a prefill chunk, sent while the prompt's later
    chunks still compute (frames: k of each attention layer, then v of each, every one
    (n, page, kv_heads, head_dim); on a CPU pool they are sent straight from it)."""

    tag: ClassVar[str] = "kv"
    room: str
    first_page: int
    tensors: list[TensorSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaChunk:
    """prefill -> decode: the final conv + SSM state of Mamba layers first_layer.. (frames: conv
    (conv_dim, K-1) of each layer, then ssm (heads, head_dim, d_state) of each), pushed ahead of
    the StateTransfer so the decode side installs one group while the next is on the wire. A
    StateTransfer whose conv/ssm carry no layers means all of them came this way."""

    tag: ClassVar[str] = "mamba"
    room: str
    first_layer: int
    tensors: list[TensorSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardTransfer:
    """prefill rank -> decode rank, when either side runs TP > 1: the slices of one room's K/V
    pages (from `first_page`), final Mamba state and block checkpoints (from `first_block`)
    that the decode rank owns and this prefill rank was planned to send it
    (disagg.tp_layout.plan); frames named `component@offset`."""

    tag: ClassVar[str] = "shard"
    room: str
    source_rank: int
    source_size: int
    first_page: int
    first_block: int
    tensors: list[TensorSpec]


Message = (
    Register
    | Reject
    | Abort
    | Heartbeat
    | HeartbeatAck
    | StateTransfer
    | KVChunk
    | MambaChunk
    | ShardTransfer
)
MESSAGES: dict[str, type] = {cls.tag: cls for cls in typing.get_args(Message)}
WITH_TENSORS = (StateTransfer, KVChunk, MambaChunk, ShardTransfer)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The header's description of each (name, tensor) frame."""
    return [TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in named]


def state_message(
    room: str, state: Any, tp_size: int = 1
) -> tuple[StateTransfer, list[torch.Tensor]]:
    """A request state's message and frames: every field of its dataclass, tensors by name."""
    carrier = type(state)
    named = [(name, getattr(state, name)) for name in tensor_fields(carrier)]
    message = StateTransfer(
        room=room,
        tp_size=tp_size,
        state={name: getattr(state, name) for name in header_fields(carrier)},
        tensors=tensor_specs(named),
    )
    return message, [t for _, t in named]


def request_state(message: StateTransfer, tensors: dict[str, torch.Tensor]) -> Any:
    """The STATE_CARRIER a decoded StateTransfer holds (its fields were checked by `decode`)."""
    return STATE_CARRIER(**message.state, **tensors)


def _parse(tag: str, raw: Any) -> Message:
    cls = MESSAGES[tag]
    carries = getattr(cls, "carries", None)
    if carries and isinstance(raw, dict) and carries in raw:
        raw = {**raw, carries: header_from_wire(STATE_CARRIER, raw[carries], f"{tag}.{carries}")}
    message = from_wire(cls, raw, tag)
    if isinstance(message, WITH_TENSORS):
        names = [spec.name for spec in message.tensors]
        if len(set(names)) != len(names):
            raise ProtocolError(f"{tag}.tensors: a tensor name appears twice in {names}")
    if isinstance(message, StateTransfer):
        expected = tensor_fields(STATE_CARRIER)
        if sorted(names) != sorted(expected):
            raise ProtocolError(
                f"{tag}.tensors: named {sorted(names)}, a request state has {sorted(expected)}"
            )
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
        {
            "v": PROTOCOL_VERSION,
            "type": message.tag,
            "ts": time.time(),
            "nonce": os.urandom(NONCE_BYTES),
            "body": message,
        },
        default=to_wire,
    )
    payload = [_frame(t) for t in tensors]
    return [header, _mac(secret, [header, *payload]), *payload]


class ReplayGuard:
    """Nonces of the authenticated messages seen within the replay window (a worker keeps one):
    a message is accepted once. Bounded: past `capacity` nonces the oldest are forgotten (a
    worker would have to receive capacity / REPLAY_WINDOW_S messages a second for that to
    matter)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self.seen: dict[bytes, float] = {}  # nonce -> when it expires, oldest first

    def admit(self, nonce: bytes, sent_at: float) -> None:
        t = time.time()
        if not abs(t - sent_at) <= REPLAY_WINDOW_S:
            raise ProtocolError(
                f"message sent {t - sent_at:+.0f} s from now, outside the {REPLAY_WINDOW_S:g} s"
                " window (are both hosts' clocks right?)"
            )
        while self.seen:  # drop the expired (and, when full, the oldest): oldest first
            oldest = next(iter(self.seen))
            if self.seen[oldest] > t and len(self.seen) < self.capacity:
                break
            del self.seen[oldest]
        if nonce in self.seen:
            raise ProtocolError("message replayed (its nonce was seen before)")
        self.seen[nonce] = t + 2 * REPLAY_WINDOW_S


def decode(
    frames: list[bytes], secret: bytes | None = None, replay: ReplayGuard | None = None
) -> tuple[Message, dict[str, torch.Tensor]]:
    """The message and its tensors by name (views of the frames), every field checked. With a
    secret and a ReplayGuard, a message outside the time window or seen before is refused."""
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    header, mac, payload = bytes(frames[0]), bytes(frames[1]), frames[2:]
    if secret is not None and not hmac.compare_digest(mac, _mac(secret, [header, *payload])):
        raise ProtocolError("message authentication failed (wrong or missing --disagg-secret)")
    try:
        raw = msgpack.unpackb(header, raw=False, strict_map_key=False)
    except Exception as error:
        raise ProtocolError(f"header is not msgpack: {error}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ProtocolError("header is not a baton disaggregation message")
    if raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks disaggregation protocol {_short(raw.get('v'))}, this worker"
            f" {PROTOCOL_VERSION} (run the same baton version on both sides)"
        )
    if raw["type"] not in MESSAGES or set(raw) != {"v", "type", "ts", "nonce", "body"}:
        raise ProtocolError(
            f"header is not a baton disaggregation message: {sorted(map(str, raw))}"
        )
    sent_at, nonce = raw["ts"], raw["nonce"]
    if not isinstance(sent_at, float) or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError("header: ts must be a float and nonce 16 bytes")
    if secret is not None and replay is not None:
        replay.admit(nonce, sent_at)
    try:
        message, tensors = _parse(raw["type"], raw.get("body")), {}
        tensors = _tensors(message, payload)
    except ProtocolError as error:
        body = raw.get("body")
        room = body.get("room") if isinstance(body, dict) else None
        error.room = room if isinstance(room, str) else None
        raise
    return message, tensors


def _tensors(message: Message, payload: list) -> dict[str, torch.Tensor]:
    specs = message.tensors if isinstance(message, WITH_TENSORS) else []
    if len(payload) != len(specs):
        raise ProtocolError(
            f"{message.tag}: {len(specs)} tensors announced, {len(payload)} frames sent"
        )
    tensors = {}
    for spec, frame in zip(specs, payload):
        if spec.dtype not in _DTYPES:
            raise ProtocolError(
                f"{message.tag}: tensor {spec.name}: unsupported dtype {spec.dtype!r}"
            )
        tensor = _view(frame, _DTYPES[spec.dtype])
        if tensor.numel() != _numel(spec.shape):
            raise ProtocolError(
                f"{message.tag}: tensor {spec.name} has {tensor.numel()} elements, header says"
                f" {spec.shape}"
            )
        tensors[spec.name] = tensor.view(spec.shape)
    return tensors


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


def _short(value: Any) -> str:
    return str(value) if isinstance(value, int) else repr(str(value)[:20])


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
