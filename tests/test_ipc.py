"""Wire messages between server and engine process, and the engine loop that speaks them."""

from __future__ import annotations

import os
import threading

import msgpack
import pytest
import zmq

from baton.engine.core.outputs import RequestDelta
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.runtime.ipc import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    RequestFailed,
    Shutdown,
    StepOutput,
    decode,
    encode,
)
from baton.engine.runtime.process import EngineLoop, EngineProcessSpec
from tests.fake_engine import FakeEngine


def _delta(**overrides) -> RequestDelta:
    fields = dict(
        request_id="r-0",
        new_token_ids=[5, 6],
        new_text="héllo 🚀",
        new_logprobs=[{5: -0.25, 9: -1.5}, {6: -0.125}],
        prompt_logprobs=[None, {3: -2.0}],
        finished=True,
        finish_reason="stop",
        stop_reason=7,
        num_prompt_tokens=4,
        num_cached_tokens=2,
    )
    fields.update(overrides)
    return RequestDelta(**fields)


MESSAGES = [
    AddRequest(
        request_id="cmpl-1-0",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=7, temperature=0.5, stop=["\n"], seed=2**62, logprobs=3),
        room="room-1",
        prefill_addr="tcp://127.0.0.1:9000",
    ),
    AbortRequests(request_ids=["a", "b"]),
    Shutdown(),
    EngineReady(
        vocab_size=320,
        max_model_len=4096,
        transfer_addr="",
        rank_transfer_addrs=[],
        page_size=16,
        track_interval=64,
    ),
    StepOutput(
        deltas=[
            _delta(),
            _delta(
                request_id="r-1",
                new_logprobs=None,
                prompt_logprobs=None,
                finished=False,
                finish_reason=None,
                stop_reason=None,
            ),
        ],
        stats={"num_running": 2, "kv_pages_used": 3},
    ),
    StepOutput(deltas=[], stats={}),
    RequestFailed(
        request_id="r-2",
        message="prompt (10 tokens) + max_tokens (5000) exceeds max_model_len (4096)",
        kind="client",
    ),
    EngineFailed(message="engine step failed: RuntimeError('boom')"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_every_message_survives_a_round_trip(message):
    assert decode(encode(message)) == message


def test_logprob_keys_stay_integers():
    decoded = decode(encode(StepOutput(deltas=[_delta()], stats={})))
    assert list(decoded.deltas[0].new_logprobs[0]) == [5, 9]


def test_decoded_sampling_params_are_validated_again():
    frame = msgpack.packb(
        ["add", {"request_id": "x", "prompt_token_ids": [1], "params": {"max_tokens": -1}}]
    )
    with pytest.raises(ValueError, match="max_tokens"):
        decode(frame)


def test_unknown_tag_is_refused():
    with pytest.raises(ValueError, match="unknown ipc message tag 'pickle'"):
        decode(msgpack.packb(["pickle", {}]))


def test_process_spec_round_trips_through_json():
    spec = EngineProcessSpec(
        model="/m",
        dtype="float32",
        device="cpu",
        engine_args={"max_model_len": 64},
        input_addr="ipc:///tmp/a",
        output_addr="ipc:///tmp/b",
        max_message_bytes=1 << 20,
        parent_pid=1,
        pair={"role": "prefill", "port": 0},
    )
    assert EngineProcessSpec.from_json(spec.to_json()) == spec


# ---- the engine loop over real zmq sockets (inproc), with a model-free engine -------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny import save_tokenizer

    path = tmp_path_factory.mktemp("fake-model")
    (path / "config.json").write_text('{"vocab_size": 320, "max_position_embeddings": 64}')
    save_tokenizer(path, vocab_size=320)
    return str(path)


@pytest.fixture
def loop(model_dir):
    """(send, receive, engine, thread) around an EngineLoop running in a thread."""
    context = zmq.Context()
    to_engine, engine_inbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    engine_outbox, from_engine = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_engine.bind("inproc://in")
    engine_inbox.connect("inproc://in")
    from_engine.bind("inproc://out")
    engine_outbox.connect("inproc://out")
    engine = FakeEngine(model_dir)
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "code", EngineLoop(engine, engine_inbox, engine_outbox, os.getppid()).run()
        )
    )
    thread.start()

    def send(message) -> None:
        to_engine.send(encode(message))

    def receive():
        assert from_engine.poll(5000), "engine loop sent nothing within 5 s"
        return decode(from_engine.recv())

    yield send, receive, engine, result
    send(Shutdown())
    thread.join(5)
    assert not thread.is_alive()
    for socket in (to_engine, engine_inbox, engine_outbox, from_engine):
        socket.close(linger=0)
    context.term()


def _until_finished(receive, request_id: str) -> list[RequestDelta]:
    deltas = []
    while not (deltas and deltas[-1].finished):
        message = receive()
        assert isinstance(message, StepOutput)
        deltas += [delta for delta in message.deltas if delta.request_id == request_id]
    return deltas


def test_loop_runs_a_request_to_its_end_and_reports_stats(loop):
    send, receive, engine, _ = loop
    send(
        AddRequest(
            request_id="a",
            prompt_token_ids=[5, 6, 7],
            params=SamplingParams(max_tokens=4),
            room="",
            prefill_addr="",
        )
    )
    deltas = _until_finished(receive, "a")
    assert sum(len(delta.new_token_ids) for delta in deltas) == 4
    assert deltas[-1].finish_reason == "length"
    assert not engine.has_unfinished_requests()


def test_loop_hands_freed_memory_back_once_when_its_last_request_ends(loop, monkeypatch):
    """While busy the heap keeps each step's temporaries for the next step; once idle they go
    back to the system (malloc_trim), once per burst and never between two steps of one."""
    from baton.engine.runtime import process

    send, receive, engine, _ = loop
    calls = []
    monkeypatch.setattr(
        process,
        "release_freed_memory",
        lambda: calls.append(engine.has_unfinished_requests()),
    )
    for burst in range(2):
        for k in range(2):
            send(
                AddRequest(
                    request_id=f"b{burst}-{k}",
                    prompt_token_ids=[5, 6, 7],
                    params=SamplingParams(max_tokens=6 + 3 * k),
                    room="",
                    prefill_addr="",
                )
            )
        _until_finished(receive, f"b{burst}-1")
        for _ in range(100):
            if len(calls) > burst:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.35)  # a few idle polls (IDLE_POLL_MS): no trim again
        assert calls == [False] * (burst + 1)


def test_loop_answers_an_invalid_request_with_request_failed(loop):
    send, receive, _, _ = loop
    send(
        AddRequest(
            request_id="bad",
            prompt_token_ids=[999],
            params=SamplingParams(max_tokens=1),
            room="",
            prefill_addr="",
        )
    )
    message = receive()
    assert isinstance(message, RequestFailed) and message.request_id == "bad"
    assert "[0, 320)" in message.message


def test_loop_abort_frees_the_request_and_says_so_in_stats(loop):
    send, receive, engine, _ = loop
    send(
        AddRequest(
            request_id="long",
            prompt_token_ids=[5],
            params=SamplingParams(max_tokens=60),
            room="",
            prefill_addr="",
        )
    )
    assert receive().stats["num_running"] == 1
    send(AbortRequests(request_ids=["long", "never-heard-of"]))
    while (stats := receive().stats)["num_running"] or stats["num_waiting"]:
        pass
    assert stats["mamba_slots_used"] == 0 and stats["kv_pages_used"] == 0
    assert not engine.has_unfinished_requests()


def test_loop_exits_cleanly_on_shutdown(loop):
    send, _, _, result = loop
    send(Shutdown())
    # the fixture's teardown joins the thread; here the exit code is what matters
    for _ in range(100):
        if "code" in result:
            break
        threading.Event().wait(0.05)
    assert result["code"] == 0


def test_the_engine_process_exempts_start_up_objects_from_the_garbage_collector(
    model_dir, monkeypatch
):
    """A full collection over everything a loaded engine holds stalls a step for tens of ms
    (engine/runtime/gc_freeze.py): the engine process freezes what exists once it has loaded."""
    import gc

    import baton.engine.runtime.process

    loaded = {"weights": []}  # stands for what loading made (a container: tracked)
    monkeypatch.setattr(baton.engine.runtime.process, "Engine", FakeEngine)
    monkeypatch.setattr(FakeEngine, "close", lambda self: None, raising=False)
    spec = EngineProcessSpec(
        model=model_dir,
        dtype="float32",
        device="cpu",
        engine_args={},
        input_addr="inproc://unused-in",
        output_addr="inproc://unused-out",
        max_message_bytes=1 << 20,
        parent_pid=os.getppid() + 1,  # not our parent: the loop exits at once
        pair=None,
    )
    context = zmq.Context()
    inbox, outbox, server = (context.socket(t) for t in (zmq.PULL, zmq.PUSH, zmq.PULL))
    server.bind("inproc://gc-freeze")
    outbox.connect("inproc://gc-freeze")
    try:
        gc.unfreeze()
        assert any(o is loaded for o in gc.get_objects())
        assert baton.engine.runtime.process._load_and_run(spec, inbox, outbox) == 0
        assert isinstance(decode(server.recv()), EngineReady)
        assert gc.get_freeze_count() > 0
        assert not any(o is loaded for o in gc.get_objects())  # frozen: never scanned
    finally:
        gc.unfreeze()
        for socket in (inbox, outbox, server):
            socket.close(linger=0)
        context.term()
