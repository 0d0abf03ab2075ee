"""Wire protocol between a prefill engine and a decode engine.

Every message is a multipart ZMQ message:

    [ header (msgpack map) | mac (32 bytes, HMAC-SHA256 of all other frames, or empty) | tensor frames... ]

Headers are the messages' dataclasses (baton.disagg.messages), their wire form derived from the fields (baton.disagg.schema):
`decode` checks the type tag and every field against its annotation, nested ones included, and
rejects anything else (a pickle payload is just bytes that do not parse as a msgpack map with a
known tag). Tensors travel as raw frames, each described in the header by name, dtype and shape,
and are handed on by name, never by position. The request state itself (baton.engine.handover.state's
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
import warnings
from typing import Any

import msgpack
import torch

from baton.disagg.messages import (
    MESSAGES,
    WITH_TENSORS,
    Message,
    ReadOffer,
    StateTransfer,
    TensorSpec,
)
from baton.disagg.schema import (
    ProtocolError,
    from_wire,
    header_fields,
    header_from_wire,
    tensor_fields,
    to_wire,
)
from baton.disagg.schema import (
    hints as schema_hints,
)
from baton.engine.handover.state import RequestState

# 2: K/V and Mamba chunks carry one frame per layer. 3: Register carries the decode side's
# transfer timeout (the prefill side keeps zero-copy sends' pages no longer than that).
# 4: StateTransfer carries RequestState's fields as derived from the dataclass, tensors by name.
# 5: the header holds a timestamp and a nonce (under the MAC): replays are refused.
# 6: Register carries the decode side's TP layout, StateTransfer the prefill side's TP size;
# ShardTransfer moves a rank's slices straight between ranks (disagg/tp_transfer.py). Compat
# compares the whole model's shapes (each side's ranks hold slices of them).
# 7: ShardTransfer carries the prompt's block checkpoints (from `first_block`), sliced like the
# final conv / SSM state.
# 8: Compat carries the checkpoint's weights fingerprint (same config, other weights refused).
# 9: state by the model's state spec: Compat lists the spec's tensors, StateTransfer's frames are
# "field/pool" (pages/attention.k, slots/mamba2.ssm, checkpoints/...), PagesChunk and SlotChunk
# (was KVChunk, MambaChunk) carry "pool#layer" frames, ShardTransfer "field/pool@offset".
# 10: Compat carries the transfer backend; ReadOffer / ReadDone (the nixl backend's reads).
# 11: ShardOffer: the nixl backend's reads rank to rank when either side runs TP > 1.
PROTOCOL_VERSION = 11

# With a secret, a message is accepted within this many seconds of the time it was sent (two
# hosts need clocks within this of each other, e.g. NTP), and only once.
REPLAY_WINDOW_S = 60.0
NONCE_BYTES = 16

# What a StateTransfer carries (a module attribute, so a test can carry an extended state).
STATE_CARRIER: type = RequestState


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The header's description of each (name, tensor) frame."""
    return [TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in named]


def state_message(
    room: str, state: Any, tp_size: int = 1
) -> tuple[StateTransfer, list[torch.Tensor]]:
    """A request state's message and frames: every field of its dataclass, tensors by name
    ("field/pool" for each tensor of a field holding tensors by pool name)."""
    named = named_tensors(state)
    message = StateTransfer(
        room=room, tp_size=tp_size, state=state_header(state), tensors=tensor_specs(named)
    )
    return message, [t for _, t in named]


def state_header(state: Any) -> dict[str, object]:
    """A request state's non-tensor fields (what a message `carries`)."""
    return {name: getattr(state, name) for name in header_fields(type(state))}


def named_tensors(state: Any) -> list[tuple[str, torch.Tensor]]:
    """A request state's tensors by frame name: "field", or "field/pool" for each tensor of a
    field holding tensors by pool name."""
    named = []
    for field in tensor_fields(type(state)):
        value = getattr(state, field)
        if isinstance(value, torch.Tensor):
            named.append((field, value))
        else:
            named.extend((f"{field}/{name}", t) for name, t in value.items())
    return named


def request_state(message: StateTransfer | ReadOffer, tensors: dict[str, torch.Tensor]) -> Any:
    """The STATE_CARRIER a decoded StateTransfer (or ReadOffer) holds (its fields were checked
    by `decode`, its frames' names too; their shapes are the receiver's to check against its
    layout)."""
    hints = schema_hints(STATE_CARRIER)
    by_field: dict[str, object] = {
        f: {} for f in tensor_fields(STATE_CARRIER) if hints[f] is not torch.Tensor
    }
    for name, t in tensors.items():
        if "/" in name:
            field, pool = name.split("/", 1)
            by_field[field][pool] = t
        else:
            by_field[name] = t
    return STATE_CARRIER(**message.state, **by_field)


def check_frames(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    """A message's frames by name against the names, shapes and dtypes the receiver expects
    (-1 in a shape: any size there). ValueError names what does not fit."""
    if set(tensors) != set(expected):
        raise ValueError(f"frames named {sorted(tensors)}, expected {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        fits = t.dim() == len(shape) and all(e in (-1, g) for e, g in zip(shape, t.shape))
        if not fits or dtype_name(t.dtype) != dtype:
            raise ValueError(
                f"frame {name} is {dtype_name(t.dtype)} {list(t.shape)}, expected {dtype}"
                f" {list(shape)}"
            )


def frame_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


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
        hints = schema_hints(STATE_CARRIER)
        plain = {f for f in tensor_fields(STATE_CARRIER) if hints[f] is torch.Tensor}
        named = {f for f in tensor_fields(STATE_CARRIER) if f not in plain}
        stray = [n for n in names if n not in plain and n.split("/", 1)[0] not in named]
        missing = plain - set(names)
        if stray or missing:
            raise ProtocolError(
                f"{tag}.tensors: {(stray or sorted(missing))[0]!r} is not a request state tensor"
                f" (one of {sorted(plain)} or field/pool with field one of {sorted(named)})"
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
