"""Property-based fuzzing of both workers' transfer sockets (issue 17): random msgpack and
mutated valid messages, signed with the right secret or not at all, thrown at an in-process
prefill worker and at a decode worker with a room waiting. After every message the engine still
serves a real request and its pools are back to zero."""

from __future__ import annotations

import os
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.disagg.decode import DecodeWorker
from baton.disagg.messages import (
    Abort,
    Heartbeat,
    PagesChunk,
    Register,
    SlotChunk,
    TensorSpec,
)
from baton.disagg.prefill import PrefillWorker
from baton.disagg.protocol import (
    PROTOCOL_VERSION,
    _mac,
    encode,
    state_message,
)
from baton.engine.core.engine import Engine
from tests.test_disagg_hardening import PARAMS, serves_a_request
from tests.test_disagg_protocol import a_state, register_body
from tests.test_disagg_unit import assert_pools_empty, config

SECRET = b"s3cret"
EXAMPLES = 40

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(0, 5), children, max_size=4)
    ),
    max_leaves=12,
)


def valid_bodies(room: str) -> list[tuple[str, dict, list[bytes]]]:
    """(tag, body, frames) of well-formed messages of every kind for `room`."""
    state, tensors = state_message(room, a_state())
    mamba = SlotChunk(
        room=room,
        first_unit=0,
        tensors=[TensorSpec(name="mamba2.conv#0", dtype="float32", shape=[2, 2])],
    )
    kv = PagesChunk(
        room=room,
        first_page=0,
        tensors=[TensorSpec(name="attention.k#0", dtype="float32", shape=[1, 4])],
    )
    messages = [
        (Register(**register_body(room=room)), []),
        (Heartbeat(rooms=[room, "other"]), []),
        (Abort(room=room, reason="fuzz"), []),
        (state, tensors),
        (mamba, [torch.zeros(2, 2)]),
        (kv, [torch.zeros(1, 4)]),
    ]
    out = []
    for message, frames in messages:
        raw = msgpack.unpackb(encode(message)[0], strict_map_key=False)
        out.append((message.tag, raw["body"], [bytes(f) for f in encode(message, frames)[2:]]))
    return out


@st.composite
def hostile_frames(draw, room: str) -> list[bytes]:
    """A multipart message: random bytes, random msgpack, or a valid message with one field (or
    the header, or the frames) mutated; signed with the secret or not."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "mutated", "mutated", "mutated"]))
    if kind == "bytes":
        frames = draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
        return frames
    if kind == "msgpack":
        header = msgpack.packb(draw(values))
        frames_after = []
    else:
        tag, body, frames_after = draw(st.sampled_from(valid_bodies(room)))
        head = {
            "v": PROTOCOL_VERSION,
            "type": tag,
            "ts": time.time(),
            "nonce": os.urandom(16),
            "body": body,
        }
        target = draw(st.sampled_from(["body-field", "nested", "header", "frames", "drop-key"]))
        if target == "header":
            head[draw(st.sampled_from(sorted(head)))] = draw(values)
        elif target == "drop-key" and body:
            body = dict(body)
            body.pop(draw(st.sampled_from(sorted(body))))
            head["body"] = body
        elif target == "frames":
            frames_after = draw(st.lists(st.binary(max_size=256), max_size=8))
        elif body:
            body = dict(body)
            key = draw(st.sampled_from(sorted(body)))
            if target == "nested" and isinstance(body[key], (dict, list)) and body[key]:
                inner = body[key]
                inner = dict(inner) if isinstance(inner, dict) else list(inner)
                index = draw(
                    st.sampled_from(list(inner) if isinstance(inner, dict) else range(len(inner)))
                )
                inner[index] = draw(values)
                body[key] = inner
            else:
                body[key] = draw(values)
            head["body"] = body
        header = msgpack.packb(head, use_bin_type=True)
    signed = draw(st.booleans())
    mac = _mac(SECRET, [header, *frames_after]) if signed else b""
    return [header, mac, *frames_after]


def make_prefill(model_dir, secret):
    return PrefillWorker(
        Engine(model_dir, page_size=4), config("prefill", secret=secret), zmq.Context.instance()
    )


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_fuzzed_messages_never_take_the_prefill_worker_down(base_model, secret):
    model_dir, _ = base_model
    worker = make_prefill(model_dir, secret)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(worker.address)
    served = [0]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(frames=hostile_frames("fuzz-room"))
    def check(frames):
        dealer.send_multipart(frames)
        deadline = time.time() + 2
        while not worker.socket.poll(10) and time.time() < deadline:
            pass
        worker.poll()
        worker.expire_idle()
        for room in list(worker.rooms):  # whatever a message opened, a request never follows
            worker.rooms.pop(room)
        served[0] += 1
        assert serves_a_request(worker, f"check{served[0]}")
        assert_pools_empty(worker)
        while dealer.poll(0):
            dealer.recv_multipart()

    try:
        check()
    finally:
        dealer.close()
        worker.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_fuzzed_messages_never_take_the_decode_worker_down(base_model, secret):
    model_dir, _ = base_model
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4), config("decode", secret=secret), zmq.Context.instance()
    )
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    count = [0]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def check(data):
        count[0] += 1
        rid = f"req{count[0]}"
        decoder.add_request(rid, [5, 6, 7, 8, 9], PARAMS, room=rid, prefill_addr=address)
        try:  # (hypothesis may abandon an example while drawing: clean up whatever happens)
            assert fake.poll(5000)
            identity, *_ = fake.recv_multipart()  # the Register
            fake.send_multipart([identity, *data.draw(hostile_frames(rid))])
            deadline = time.time() + 2
            while time.time() < deadline and rid in decoder.rooms:
                decoder.step()
                link = decoder.peers.get(address)  # closed once its room failed, unanswered
                if link is None or not link.socket.poll(10):
                    break
            decoder.step()
        finally:
            decoder.abort_request(rid)  # still waiting (the message did nothing): give up on it
            decoder.take_failures()
        assert serves_a_request(decoder, f"check{count[0]}")
        stats = decoder.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0, (
            stats,
            decoder.rooms,
            list(decoder.engine.requests),
        )
        while fake.poll(0):
            fake.recv_multipart()

    try:
        check()
    finally:
        fake.close()
        decoder.close()
