"""Typed messages between the server process and its engine process (msgpack, never pickle).

    server ──PUSH──> engine:  AddRequest | AbortRequests | Shutdown | AdapterCommand
    server <──PULL── engine:  EngineReady (once) | StepOutput | RequestFailed | EngineFailed
                              | AdapterDone (one per AdapterCommand)

A frame is msgpack `[tag, payload]`; every message class names its tag and converts itself to
and from a payload of plain msgpack types. Decoding an unknown tag raises ValueError.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import msgpack

from baton.engine.core.outputs import RequestDelta
from baton.engine.core.sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True, slots=True)
class AddRequest:
    tag: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    room: str  # disaggregation room minted by the router ("" when colocated)
    prefill_addr: str  # decode side: the prefill engine's transfer address ("" otherwise)

    def to_payload(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "params": dataclasses.asdict(self.params),
            "room": self.room,
            "prefill_addr": self.prefill_addr,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> AddRequest:
        return cls(
            request_id=payload["request_id"],
            prompt_token_ids=payload["prompt_token_ids"],
            params=SamplingParams.from_dict(payload["params"]),
            room=payload["room"],
            prefill_addr=payload["prefill_addr"],
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class AbortRequests:
    tag: ClassVar[str] = "abort"
    request_ids: list[str]

    def to_payload(self) -> dict[str, Any]:
        return {"request_ids": list(self.request_ids)}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> AbortRequests:
        return cls(request_ids=payload["request_ids"])


@dataclass(frozen=True, kw_only=True, slots=True)
class Shutdown:
    tag: ClassVar[str] = "shutdown"

    def to_payload(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Shutdown:
        return cls()


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineReady:
    """Sent once the model is loaded: what the server needs to validate requests."""

    tag: ClassVar[str] = "ready"
    vocab_size: int
    max_model_len: int
    transfer_addr: str  # prefill worker: where decode engines register ("" otherwise)
    # disaggregated worker: each tensor-parallel rank's shard address, rank order ("" for a
    # rank that receives none: every prefill rank sends from its own socket)
    rank_transfer_addrs: list[str]
    # The prefix cache's geometry, for a cache-aware router: a prompt is reusable up to the last
    # multiple of `track_interval` (0: no prefix cache) it shares with a cached one.
    page_size: int
    track_interval: int

    def to_payload(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "transfer_addr": self.transfer_addr,
            "rank_transfer_addrs": self.rank_transfer_addrs,
            "page_size": self.page_size,
            "track_interval": self.track_interval,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> EngineReady:
        return cls(
            vocab_size=payload["vocab_size"],
            max_model_len=payload["max_model_len"],
            transfer_addr=payload["transfer_addr"],
            rank_transfer_addrs=list(payload["rank_transfer_addrs"]),
            page_size=payload["page_size"],
            track_interval=payload["track_interval"],
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutput:
    """Deltas of one engine step (possibly none) and the engine's counters after it.

    `stats` is `dataclasses.asdict(EngineStats)`: gauges and cumulative counters by name.
    """

    tag: ClassVar[str] = "step"
    deltas: list[RequestDelta]
    stats: dict[str, int | float]

    def to_payload(self) -> dict[str, Any]:
        return {
            "deltas": [_delta_to_payload(delta) for delta in self.deltas],
            "stats": dict(self.stats),
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> StepOutput:
        return cls(
            deltas=[RequestDelta(**delta) for delta in payload["deltas"]],
            stats=payload["stats"],
        )


# Whose fault a failed request is: "client" (the request itself is invalid: HTTP 400) or
# "server" (a disaggregated handover failed, the pair is misconfigured: HTTP 503).
FailureKind = Literal["client", "server"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestFailed:
    """The engine refused or dropped one request; `message` is meant for the client."""

    tag: ClassVar[str] = "failed"
    request_id: str
    message: str
    kind: FailureKind

    def to_payload(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "message": self.message, "kind": self.kind}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> RequestFailed:
        return cls(
            request_id=payload["request_id"], message=payload["message"], kind=payload["kind"]
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineFailed:
    """The engine hit an internal error and is exiting; every in-flight request fails."""

    tag: ClassVar[str] = "fatal"
    message: str

    def to_payload(self) -> dict[str, Any]:
        return {"message": self.message}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> EngineFailed:
        return cls(message=payload["message"])


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterCommand:
    """Load (from `path`) or unload LoRA adapter `name` (engine/lora/); answered by an
    AdapterDone with the same call_id."""

    tag: ClassVar[str] = "adapter"
    call_id: str
    action: Literal["load", "unload"]
    name: str
    path: str  # "" for unload

    def to_payload(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in ("call_id", "action", "name", "path")}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> AdapterCommand:
        if payload["action"] not in ("load", "unload"):
            raise ValueError(f"unknown adapter action {payload['action']!r}")
        return cls(**{f: str(payload[f]) for f in ("call_id", "action", "name", "path")})


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterDone:
    """The answer to an AdapterCommand: `error` says why it was refused ("" when done)."""

    tag: ClassVar[str] = "adapter_done"
    call_id: str
    error: str

    def to_payload(self) -> dict[str, Any]:
        return {"call_id": self.call_id, "error": self.error}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> AdapterDone:
        return cls(call_id=str(payload["call_id"]), error=str(payload["error"]))


def _delta_to_payload(delta: RequestDelta) -> dict[str, Any]:
    # Logprob dicts keep their int keys: msgpack maps allow them (decode with strict_map_key off).
    return {field.name: getattr(delta, field.name) for field in dataclasses.fields(delta)}


Message = (
    AddRequest
    | AbortRequests
    | Shutdown
    | EngineReady
    | StepOutput
    | RequestFailed
    | EngineFailed
    | AdapterCommand
    | AdapterDone
)

_BY_TAG: dict[str, type] = {
    cls.tag: cls
    for cls in (
        AddRequest,
        AbortRequests,
        Shutdown,
        EngineReady,
        StepOutput,
        RequestFailed,
        EngineFailed,
        AdapterCommand,
        AdapterDone,
    )
}


def encode(message: Message) -> bytes:
    return msgpack.packb([message.tag, message.to_payload()], use_bin_type=True)


def decode(frame: bytes) -> Message:
    tag, payload = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise ValueError(f"unknown ipc message tag {tag!r}")
    return cls.from_payload(payload)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineProcessSpec:
    """Everything the engine process needs, passed as JSON on its command line (here, with
    the messages, so that the server builds it without importing the engine and torch)."""

    model: str
    dtype: str
    device: str
    engine_args: dict[str, Any]  # Engine keyword arguments the user set (unset ones omitted)
    input_addr: str  # zmq address the server pushes requests to
    output_addr: str  # zmq address the server pulls outputs from
    max_message_bytes: int  # the largest frame the server sends (socket_limits.add_request_bytes)
    parent_pid: int
    # the options of the prefill or decode worker that wraps this engine (its own process
    # module reads them); None when colocated
    pair: dict[str, Any] | None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineProcessSpec:
        return cls(**json.loads(text))
