"""The handover's wire form is derived from the dataclasses: every field crosses (a new one too),
tensors are matched by name, and every field of a received message is checked before use."""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
import typing

import msgpack
import pytest
import torch

from baton.disagg import messages, protocol
from baton.disagg.messages import (
    Compat,
    Heartbeat,
    Message,
    PagesChunk,
    Register,
    StateTransfer,
    TensorSpec,
)
from baton.disagg.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
    request_state,
    state_message,
)
from baton.engine.handover.state import RequestState


def a_state(**overrides) -> RequestState:
    g = torch.Generator().manual_seed(0)
    values = dict(
        num_prompt_tokens=9,
        first_token=4,
        first_logprobs={4: -0.25, 7: -1.5},
        first_page=1,
        first_block=0,
        pages={
            "attention.k": torch.randn(2, 2, 4, 1, 3, generator=g),
            "attention.v": torch.randn(2, 2, 4, 1, 3, generator=g),  # the same shape as k
        },
        slots={
            "mamba2.conv": torch.randn(3, 6, 2, generator=g),
            "mamba2.ssm": torch.randn(3, 2, 3, 4, generator=g),
        },
        checkpoints={
            "mamba2.conv": torch.randn(1, 3, 6, 2, generator=g),
            "mamba2.ssm": torch.randn(1, 3, 2, 3, 4, generator=g),
        },
    )
    return RequestState(**(values | overrides))


def over_the_wire(message, tensors, secret=b"k"):
    return decode([bytes(f) for f in encode(message, tensors, secret=secret)], secret=secret)


def assert_same_state(got, sent) -> None:
    assert type(got) is type(sent)
    for field in dataclasses.fields(sent):
        mine, theirs = getattr(got, field.name), getattr(sent, field.name)
        if isinstance(theirs, torch.Tensor):
            assert torch.equal(mine, theirs), field.name
        elif isinstance(theirs, dict) and any(isinstance(t, torch.Tensor) for t in theirs.values()):
            assert mine.keys() == theirs.keys(), field.name
            for name in theirs:
                assert torch.equal(mine[name], theirs[name]), (field.name, name)
        else:
            assert mine == theirs, field.name


def test_every_request_state_field_crosses_the_wire():
    state = a_state()
    message, tensors = state_message("room", state)
    decoded, named = over_the_wire(message, tensors)
    assert_same_state(request_state(decoded, named), state)


def test_a_field_added_to_the_request_state_crosses_the_wire(monkeypatch):
    """Nothing lists RequestState's fields: a new scalar and a new tensor arrive without any
    change to the protocol or the workers."""
    extended = dataclasses.make_dataclass(
        "ExtendedState",
        [("priority", int), ("draft_logits", torch.Tensor)],
        bases=(RequestState,),
        frozen=True,
        kw_only=True,
        slots=True,
    )
    monkeypatch.setattr(protocol, "STATE_CARRIER", extended)
    base = dataclasses.asdict(a_state())  # (asdict copies the tensors: fine here)
    state = extended(**base, priority=3, draft_logits=torch.arange(6.0).view(2, 3))
    message, tensors = state_message("room", state)
    assert message.state["priority"] == 3
    assert "draft_logits" in [spec.name for spec in message.tensors]
    decoded, named = over_the_wire(message, tensors)
    assert_same_state(request_state(decoded, named), state)


def test_k_and_v_frames_in_another_order_still_land_in_k_and_v():
    """K and V have the same shape: only their names tell them apart. A sender that orders the
    frames differently (V first) must not swap them."""
    state = a_state()
    message, tensors = state_message("room", state)
    names = [spec.name for spec in message.tensors]
    assert names[:2] == ["pages/attention.k", "pages/attention.v"]
    order = list(range(len(tensors)))
    order[0], order[1] = 1, 0
    swapped = dataclasses.replace(message, tensors=[message.tensors[i] for i in order])
    decoded, named = over_the_wire(swapped, [tensors[i] for i in order])
    got = request_state(decoded, named)
    assert torch.equal(got.pages["attention.k"], state.pages["attention.k"])
    assert torch.equal(got.pages["attention.v"], state.pages["attention.v"])


@pytest.mark.parametrize(
    "names, error",
    [
        (["pages/attention.k", "pages/attention.k"], "appears twice"),
        (["pages/attention.k", "values"], "not a request state tensor"),
        (["pages/attention.k", "weights/attention.v"], "not a request state tensor"),
    ],
)
def test_misnamed_state_tensors_are_refused(names, error):
    message, tensors = state_message("room", a_state())
    specs = [dataclasses.replace(s, name=n) for s, n in zip(message.tensors, names)]
    renamed = dataclasses.replace(message, tensors=specs + message.tensors[2:])
    with pytest.raises(ProtocolError, match=error):
        over_the_wire(renamed, tensors)


def test_the_message_union_lists_every_message_class():
    declared = {
        cls
        for _, cls in inspect.getmembers(messages, inspect.isclass)
        if cls.__module__ == messages.__name__ and isinstance(getattr(cls, "tag", None), str)
    }
    assert set(typing.get_args(Message)) == declared
    assert set(messages.MESSAGES.values()) == declared


def raw_message(tag: str, body) -> list[bytes]:
    header = {"v": PROTOCOL_VERSION, "type": tag, "ts": time.time(), "nonce": b"n" * 16}
    return [msgpack.packb(header | {"body": body}), b""]


def register_body(**overrides) -> dict:
    compat = dict(
        transfer_backend="zmq",
        model="m",
        weights="w",
        dtype="float32",
        page_size=4,
        state=["attention.k: paged x1 [1, 3] float32", "mamba2.ssm: slot x1 [2, 3, 4] float32"],
    )
    body = dict(
        room="r",
        compat=compat,
        num_prompt_tokens=9,
        cached_tokens=0,
        track_interval=0,
        transfer_timeout_s=30.0,
        tp=dict(size=1, rank_addresses=[""]),
    )
    return body | overrides


def test_a_well_formed_register_parses_with_its_nested_compat():
    message, tensors = decode(raw_message("register", register_body(transfer_timeout_s=30)))
    assert isinstance(message, Register) and isinstance(message.compat, Compat)
    assert message.transfer_timeout_s == 30.0 and tensors == {}


@pytest.mark.parametrize(
    "tag, body, field",
    [
        ("register", register_body(transfer_timeout_s="30"), "transfer_timeout_s"),
        ("register", register_body(transfer_timeout_s=math.nan), "transfer_timeout_s"),
        ("register", register_body(num_prompt_tokens=True), "num_prompt_tokens"),
        ("register", register_body(cached_tokens=-1), "cached_tokens"),
        ("register", register_body(room=["r"]), "room"),
        ("register", register_body(room="x" * 5000), "room"),
        ("register", register_body(compat={"model": "m"}), "compat"),
        ("register", register_body(tp=dict(size=-2, rank_addresses=[])), "tp.size"),
        ("register", register_body(tp=dict(size=1, rank_addresses=[7])), "tp.rank_addresses"),
        (
            "register",
            register_body(compat=dict(register_body()["compat"], page_size="4")),
            "page_size",
        ),
        (
            "register",
            register_body(compat=dict(register_body()["compat"], state=[[1]])),
            "state",
        ),
        ("heartbeat", {"rooms": 5}, "rooms"),
        ("heartbeat", {"rooms": [["a"]]}, "rooms"),
        ("heartbeat", {"rooms": ["a"] * 70000}, "rooms"),
        ("abort", {"room": "r", "reason": 1}, "reason"),
        (
            "pages",
            {
                "room": "r",
                "first_page": 0,
                "tensors": [{"name": 1, "dtype": "float32", "shape": [1]}],
            },
            "name",
        ),
        (
            "pages",
            {
                "room": "r",
                "first_page": 0,
                "tensors": [{"name": "k0", "dtype": "float32", "shape": [-1]}],
            },
            "shape",
        ),
        ("pages", {"room": "r", "first_page": 0, "tensors": "k0"}, "tensors"),
    ],
)
def test_every_field_is_checked_against_its_annotation(tag, body, field):
    with pytest.raises(ProtocolError, match=field) as refused:
        decode(raw_message(tag, body))
    assert refused.value.room == (body.get("room") if isinstance(body.get("room"), str) else None)


def test_malformed_first_logprobs_are_refused():
    message, tensors = state_message("r", a_state())
    for bad in ({"4": -0.5}, {4: "x"}, [1, 2], {4: math.inf}):
        forged = dataclasses.replace(message, state=message.state | {"first_logprobs": bad})
        with pytest.raises(ProtocolError, match="first_logprobs"):
            over_the_wire(forged, tensors)


def test_frame_counts_and_sizes_must_match_the_header():
    message, tensors = state_message("r", a_state())
    frames = [bytes(f) for f in encode(message, tensors)]
    with pytest.raises(ProtocolError, match="frames sent"):
        decode(frames[:2])  # a state message with no tensor frames
    with pytest.raises(ProtocolError, match="frames sent"):
        decode([*frames, b"\0" * 4])
    with pytest.raises(ProtocolError, match="elements"):
        decode([*frames[:2], frames[2][:-4], *frames[3:]])
    heartbeat = [bytes(f) for f in encode(Heartbeat(rooms=["a"]))]
    with pytest.raises(ProtocolError, match="0 tensors announced, 1 frames"):
        decode([*heartbeat, b"\0" * 4])
    chunk = PagesChunk(
        room="r", first_page=0, tensors=[TensorSpec(name="k0", dtype="int8", shape=[1])]
    )
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        decode([bytes(f) for f in encode(chunk, [torch.zeros(1)])])


def test_state_transfer_declares_no_request_state_field_itself():
    """The request state's fields live in one place, RequestState."""
    names = {f.name for f in dataclasses.fields(StateTransfer)}
    assert names.isdisjoint(f.name for f in dataclasses.fields(RequestState))
