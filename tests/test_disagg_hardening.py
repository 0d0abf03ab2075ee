"""No peer message and no request field can take a disaggregated worker's engine down (issue 17,
findings 1, 2 and 6): each is refused, logged, counted and answered, and the engine keeps
serving with its pools back to zero. Workers run in-process, driven as their engine loop
drives them."""

from __future__ import annotations

import os
import socket
import time

import msgpack
import pytest
import zmq

from baton import SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.messages import (
    Heartbeat,
    HeartbeatAck,
    PagesChunk,
    Register,
    Reject,
    TensorSpec,
)
from baton.disagg.peer_link import MAX_UNVERIFIED_LINKS
from baton.disagg.prefill import PrefillWorker
from baton.disagg.process import DisaggEngineLoop
from baton.disagg.protocol import (
    PROTOCOL_VERSION,
    decode,
    encode,
    state_message,
)
from baton.engine.core.engine import Engine
from baton.server.args import ServerArgs
from tests.server_process import free_port
from tests.test_disagg_protocol import a_state, register_body
from tests.test_disagg_unit import assert_pools_empty, config

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def serves_a_request(worker, request_id: str = "check") -> bool:
    """The worker's engine still runs a plain request to the end (and frees it)."""
    worker.add_request(request_id, [5, 6, 7, 8], PARAMS)
    tokens = []
    deadline = time.time() + 30
    while worker.computing() and time.time() < deadline:
        for delta in worker.step():
            tokens.extend(delta.new_token_ids)
    return len(tokens) == PARAMS.max_tokens


def header(tag, body, **fields) -> bytes:
    values = {"v": PROTOCOL_VERSION, "type": tag, "ts": time.time(), "nonce": os.urandom(16)}
    return msgpack.packb(values | {"body": body} | fields)


def receive_all(socket: zmq.Socket, wait_s: float = 0.5) -> list:
    out = []
    while socket.poll(int(wait_s * 1000)):
        out.append(decode(socket.recv_multipart())[0])
    return out


@pytest.fixture
def prefill(base_model):
    model_dir, _ = base_model
    worker = PrefillWorker(
        Engine(model_dir, page_size=4), config("prefill", secret=None), zmq.Context.instance()
    )
    yield worker
    worker.close()


@pytest.fixture
def dealer(prefill):
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(prefill.address)
    yield socket
    socket.close()


# -- finding 1: crafted messages to the prefill worker's transfer port --------------------------


def test_crafted_messages_are_refused_and_the_prefill_engine_keeps_serving(prefill, dealer):
    crafted = [
        [header(["register"], {}), b""],  # a list where the type is expected (unhashable)
        [header("heartbeat", {"rooms": 5}), b""],
        [header("heartbeat", {"rooms": [["a"], ["b"]]}), b""],
        [header("register", register_body(room="r1", transfer_timeout_s="30")), b""],
        [header("register", register_body(room="r2", compat=[1, 2])), b""],
        [header("abort", {"room": {"x": 1}, "reason": "x"}), b""],
        [header("state", {"room": "r3"}), b""],  # a message only decode workers receive
        [msgpack.packb([1, 2, 3]), b""],
        [b"\xc1", b""],  # not msgpack at all
        [b"x"],  # one frame
    ]
    for frames in crafted:
        dealer.send_multipart(frames)
    time.sleep(0.3)
    prefill.poll()  # raised into the engine loop before
    assert prefill.counters.messages_refused == len(crafted)
    answers = receive_all(dealer)
    # Messages that named their room (as a string) are answered with a Reject naming the field.
    rejects = {m.room: m.message for m in answers if isinstance(m, Reject)}
    assert set(rejects) == {"r1", "r2", "r3"}
    assert "transfer_timeout_s" in rejects["r1"] and "compat" in rejects["r2"]
    assert not prefill.rooms
    assert serves_a_request(prefill)
    assert_pools_empty(prefill)


def test_a_decode_worker_may_hold_only_so_many_rooms(base_model, dealer, prefill):
    limit = prefill.config.max_rooms_per_peer
    for i in range(limit + 5):
        body = register_body(room=f"room{i}") | {"compat": prefill.compat}
        message = Register(**(body | {"transfer_timeout_s": 30.0}))
        dealer.send_multipart(encode(message))
    time.sleep(0.3)
    prefill.poll()
    assert len(prefill.rooms) == limit
    rejects = [m for m in receive_all(dealer) if isinstance(m, Reject)]
    assert len(rejects) == 5 and "--disagg-max-rooms-per-peer" in rejects[0].message


def test_rooms_that_never_see_their_request_expire_while_the_worker_idles(base_model):
    """Registers with no request behind them: the idle engine loop (no request runs, no more
    messages come) expires them after the bootstrap timeout."""
    model_dir, _ = base_model
    context = zmq.Context.instance()
    worker = PrefillWorker(
        Engine(model_dir, page_size=4),
        config("prefill", secret=None, bootstrap_timeout_s=0.5, lease_timeout_s=0.5),
        context,
    )
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.bind("inproc://hardening-in")
    outbox.bind("inproc://hardening-out")
    sink = context.socket(zmq.PULL)
    sink.connect("inproc://hardening-out")
    loop = DisaggEngineLoop(worker, inbox, outbox, os.getppid())

    def run_loop_once():
        loop._wait_for_messages()
        while sink.poll(0):  # what the loop reports to its server (StepOutputs)
            sink.recv()

    dealer = context.socket(zmq.DEALER)
    dealer.connect(worker.address)
    try:
        for i in range(20):
            body = register_body(room=f"idle{i}") | {"compat": worker.compat}
            dealer.send_multipart(encode(Register(**(body | {"transfer_timeout_s": 30.0}))))
        deadline = time.time() + 5
        while len(worker.rooms) < 20 and time.time() < deadline:
            run_loop_once()
        assert len(worker.rooms) == 20
        heartbeats_until = time.time() + 1.0  # heartbeats do not keep request-less rooms
        while time.time() < heartbeats_until:
            dealer.send_multipart(encode(Heartbeat(rooms=[f"idle{i}" for i in range(20)])))
            run_loop_once()
        assert not worker.rooms and not worker.has_unfinished_requests()
        assert worker.counters.transfers_failed == 20
    finally:
        for socket in (dealer, sink, inbox, outbox):
            socket.close(linger=0)
        worker.close()


# -- replays and exposure ---------------------------------------------------------------------


def test_a_replayed_or_stale_message_is_refused_with_a_secret(base_model):
    model_dir, _ = base_model
    worker = PrefillWorker(
        Engine(model_dir, page_size=4), config("prefill"), zmq.Context.instance()
    )
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(worker.address)
    try:
        frames = [bytes(f) for f in encode(Heartbeat(rooms=["x"]), secret=b"s3cret")]
        for _ in range(2):
            dealer.send_multipart(frames)
        time.sleep(0.3)
        worker.poll()
        assert worker.counters.messages_refused == 1  # the replay
        acks = [m for m in receive_all(dealer) if isinstance(m, HeartbeatAck)]
        assert len(acks) == 1
        stale = msgpack.unpackb(frames[0])
        stale["ts"] -= 61.0
        forged = msgpack.packb(stale)
        from baton.disagg.protocol import _mac

        dealer.send_multipart([forged, _mac(b"s3cret", [forged])])
        time.sleep(0.3)
        worker.poll()
        assert worker.counters.messages_refused == 2 and not receive_all(dealer, 0.2)
    finally:
        dealer.close(linger=0)
        worker.close()


def test_a_prefill_worker_beyond_loopback_needs_a_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_DISAGG_SECRET", raising=False)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--disagg-secret"):
        ServerArgs(model=str(tmp_path), disaggregation_mode="prefill", disagg_host="0.0.0.0")
    ServerArgs(model=str(tmp_path), disaggregation_mode="prefill", disagg_host="127.0.0.1")
    ServerArgs(
        model=str(tmp_path),
        disaggregation_mode="prefill",
        disagg_host="0.0.0.0",
        disagg_secret="s",
    )
    with pytest.raises(ValueError, match="without a shared secret"):
        PrefillWorker(None, config("prefill", secret=None, host="0.0.0.0"), zmq.Context.instance())


# -- finding 2: the decode side ---------------------------------------------------------------


@pytest.fixture
def decoder(base_model):
    model_dir, _ = base_model
    worker = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), zmq.Context.instance())
    yield worker
    worker.close()


@pytest.mark.parametrize(
    "address", ["not-a-zmq-endpoint", "tcp://", "tcp://host:99999", "ipc:///tmp/x", "tcp://a b:1"]
)
def test_a_malformed_prefill_address_is_a_clear_error_not_a_dead_engine(decoder, address):
    with pytest.raises(ValueError, match="prefill_addr"):
        decoder.add_request("r", [5, 6, 7], PARAMS, room="room", prefill_addr=address)
    assert not decoder.rooms and not decoder.queued
    assert serves_a_request(decoder)
    assert_pools_empty(decoder)


@pytest.fixture
def fake_prefill():
    """A ROUTER socket standing in for a prefill worker that sends what a test tells it to."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close()


def registered_room(decoder, fake_prefill, request_id: str) -> tuple[bytes, str]:
    socket, address = fake_prefill
    decoder.add_request(request_id, [5, 6, 7, 8, 9], PARAMS, room=request_id, prefill_addr=address)
    assert socket.poll(5000)
    identity, *frames = socket.recv_multipart()
    message, _ = decode(frames, b"s3cret")
    assert isinstance(message, Register)
    return identity, message.room


def forged_states(room: str) -> list[tuple[str, list]]:
    """(what is wrong, frames) of state messages a hostile or broken prefill worker might send,
    each properly signed."""
    message, tensors = state_message(room, a_state())
    bad_logprobs = message.__class__(
        room=room,
        tp_size=1,
        state=message.state | {"first_logprobs": {"a": "b"}},
        tensors=message.tensors,
    )
    wrong_shapes = PagesChunk(
        room=room,
        first_page=0,
        tensors=[TensorSpec(name="attention.k#0", dtype="float32", shape=[1, 3])],
    )
    import torch

    return [
        ("malformed first_logprobs", encode(bad_logprobs, tensors, secret=b"s3cret")),
        ("no tensor frames", encode(message, [], secret=b"s3cret")[:2]),
        ("frames of another model", encode(message, tensors, secret=b"s3cret")),
        ("a chunk of the wrong shape", encode(wrong_shapes, [torch.zeros(1, 3)], b"s3cret")),
    ]


@pytest.mark.parametrize("case", range(4))
def test_a_hostile_prefill_worker_fails_the_room_not_the_engine(decoder, fake_prefill, case):
    socket, _ = fake_prefill
    identity, room = registered_room(decoder, fake_prefill, f"req{case}")
    what, frames = forged_states(room)[case]
    socket.send_multipart([identity, *frames])
    deadline = time.time() + 5
    while decoder.rooms and time.time() < deadline:
        decoder.step()  # raised into the engine loop before
    failures = decoder.take_failures()
    assert [rid for rid, _ in failures] == [f"req{case}"], what
    assert decoder.counters.messages_refused == 1, what
    aborts = [decode(f[1:], b"s3cret")[0] for f in _drain(socket)]
    assert any(getattr(m, "room", None) == room for m in aborts), what  # the peer is told
    assert serves_a_request(decoder)
    assert_pools_empty(decoder)


def _drain(socket: zmq.Socket) -> list[list[bytes]]:
    out = []
    while socket.poll(200):
        out.append(socket.recv_multipart())
    return out


@pytest.fixture
def sharded_decoder(base_model, monkeypatch):
    """A decode worker that takes state from a prefill worker's ranks (its shard connector)."""
    from baton.disagg.tp_transfer import SECRET_ENV, connector_spec

    monkeypatch.setenv(SECRET_ENV, "shards")
    model_dir, _ = base_model
    engine = Engine(
        model_dir, page_size=4, handover_connector=connector_spec("decode", "127.0.0.1")
    )
    worker = DecodeWorker(engine, config("decode"), zmq.Context.instance())
    yield worker
    worker.close()
    engine.close()


def test_an_ack_saying_unknown_fails_a_waiting_room_but_not_one_whose_state_came(
    sharded_decoder, fake_prefill
):
    """A prefill worker forgets a room once it sent its final state; with TP on the prefill
    side the state's shards come rank to rank after it. An ack to a heartbeat sent before the
    state arrived then says "unknown": that room waits on for its shards, while a room the
    prefill worker never had (nothing arrived) fails."""
    socket, _ = fake_prefill
    identity, sent = registered_room(sharded_decoder, fake_prefill, "sent")
    _, lost = registered_room(sharded_decoder, fake_prefill, "lost")
    rank0_part = sharded_decoder.engine.handover.first_token_state(
        a_state(num_prompt_tokens=5, checkpoints={})
    )
    message, tensors = state_message(sent, rank0_part, tp_size=2)
    socket.send_multipart([identity, *encode(message, tensors, secret=b"s3cret")])
    time.sleep(
        sharded_decoder.config.heartbeat_interval_s * 1.5
    )  # both rooms older than a heartbeat
    ack = HeartbeatAck(unknown_rooms=[sent, lost])
    socket.send_multipart([identity, *encode(ack, [], secret=b"s3cret")])
    deadline = time.time() + 5
    while lost in sharded_decoder.rooms and time.time() < deadline:
        sharded_decoder.step()
    failures = sharded_decoder.take_failures()
    assert [rid for rid, _ in failures] == ["lost"], failures
    assert sharded_decoder.rooms[sent].sharded is not None  # waiting for the prefill ranks' shards


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _step_until_failed(decoder, count: int, timeout_s: float = 20) -> list[tuple[str, str]]:
    failures: list[tuple[str, str]] = []
    deadline = time.time() + timeout_s
    while len(failures) < count and time.time() < deadline:
        decoder.step()
        failures += decoder.take_failures()
        time.sleep(0.01)
    return failures


def test_a_prefill_address_where_nothing_listens_fails_at_once_and_is_not_dialed_again(decoder):
    """Issue 51.10: requests naming closed loopback ports each held the engine 30 s, left their
    sockets open and ZMQ redialing the ports for good. Now each fails as its connection is
    refused, the link is closed, and a listener opened later on that port hears nothing."""
    before = _open_fds()
    ports = [free_port() for _ in range(12)]
    for i, port in enumerate(ports):
        address = f"tcp://127.0.0.1:{port}"
        decoder.add_request(f"r{i}", [5, 6, 7, 8], PARAMS, room=f"room{i}", prefill_addr=address)
    failures = _step_until_failed(decoder, len(ports), timeout_s=decoder.config.bootstrap_timeout_s)
    assert sorted(f[0] for f in failures) == sorted(f"r{i}" for i in range(len(ports)))
    assert all(
        "never answered" in reason and "(connection refused)" in reason for _, reason in failures
    ), failures
    assert decoder.peers.items() == [] and _open_fds() <= before
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[0]))
        listener.listen()
        listener.settimeout(1.0)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert serves_a_request(decoder)
    assert_pools_empty(decoder)


def test_unanswered_prefill_links_are_bounded_and_closed_with_their_rooms(decoder):
    """Listeners that accept and never answer: at most MAX_UNVERIFIED_LINKS such links at once
    (the next address is refused by name, nothing reserved for it), all closed when their
    rooms are aborted."""
    silent = []
    try:
        for _ in range(MAX_UNVERIFIED_LINKS + 1):
            router = zmq.Context.instance().socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            silent.append(
                (router, f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
            )
        for i, (_, address) in enumerate(silent[:-1]):
            decoder.add_request(f"s{i}", [5, 6, 7], PARAMS, room=f"s{i}", prefill_addr=address)
        with pytest.raises(ValueError, match="have not answered yet"):
            decoder.add_request(
                "extra", [5, 6, 7], PARAMS, room="extra", prefill_addr=silent[-1][1]
            )
        assert "extra" not in decoder.rooms and len(decoder.peers.items()) == MAX_UNVERIFIED_LINKS
        for i in range(MAX_UNVERIFIED_LINKS):
            decoder.abort_request(f"s{i}")
        decoder.expire_idle()
        assert decoder.peers.items() == []
        assert serves_a_request(decoder)
        assert_pools_empty(decoder)
    finally:
        for router, _ in silent:
            router.close()
