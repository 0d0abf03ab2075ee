"""Disaggregation without HTTP: protocol schemas and the prefill/decode workers in one process."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import zmq

from disagg.decode import DecodeWorker
from disagg.prefill import PrefillWorker
from disagg.protocol import (
    Abort,
    Heartbeat,
    ProtocolError,
    StateTransfer,
    TensorSpec,
    decode,
    encode,
)
from disagg.rooms import DisaggConfig
from engine import SamplingParams
from engine.engine import Engine


def config(role, **overrides):
    values = dict(role=role, host="127.0.0.1", port=0, secret=b"s3cret", bootstrap_timeout_s=5.0,
                  transfer_timeout_s=5.0, heartbeat_interval_s=0.2, lease_timeout_s=1.5)
    values.update(overrides)
    return DisaggConfig(**values)


def test_messages_round_trip_with_tensors_and_mac():
    message = StateTransfer(room="r", num_prompt_tokens=7, first_token=3, first_logprobs={3: -0.5},
                            tensors=[TensorSpec(name="k", dtype="bfloat16", shape=[2, 3])])
    tensor = torch.randn(2, 3).bfloat16()
    frames = [bytes(f) for f in encode(message, [tensor], secret=b"k")]
    decoded, tensors = decode(frames, secret=b"k")
    assert decoded == message and torch.equal(tensors[0], tensor)
    assert decode([bytes(f) for f in encode(Heartbeat(rooms=["a"]))])[0] == Heartbeat(rooms=["a"])


def test_pickle_payload_is_rejected():
    class Evil:
        def __reduce__(self):
            return (print, ("pickle executed",))

    for payload in (pickle.dumps(Evil()), pickle.dumps({"type": "abort", "room": "x"})):
        with pytest.raises(ProtocolError):
            decode([payload, b""])


def test_wrong_secret_and_wrong_schema_are_rejected():
    frames = [bytes(f) for f in encode(Abort(room="r", reason="x"), secret=b"a")]
    with pytest.raises(ProtocolError, match="authentication"):
        decode(frames, secret=b"b")
    import msgpack

    bad = msgpack.packb({"v": 1, "type": "abort", "body": {"room": "r", "reason": "x", "extra": 1}})
    with pytest.raises(ProtocolError, match="fields"):
        decode([bad, b""])


def run_pair(prefill, decoder, prompts, params, timeout=20.0):
    got = {}
    for i, prompt in enumerate(prompts):
        decoder.add_request(f"r{i}", prompt, params, room=f"room{i}", prefill_addr=prefill.address)
        prefill.add_request(f"r{i}", prompt, params, room=f"room{i}")
    start = time.time()
    while (decoder.has_unfinished_requests() or prefill.has_unfinished_requests()) and time.time() - start < timeout:
        prefill.step()
        for delta in decoder.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return got


def test_pair_is_token_identical_to_colocated_and_frees_everything(base_model):
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (1, 6, 45, 130)]
    colocated = Engine(model_dir, page_size=4)
    expect = {}
    for i, p in enumerate(prompts):
        colocated.add_request(f"r{i}", p, params)
    while colocated.has_unfinished_requests():
        for d in colocated.step():
            expect.setdefault(d.request_id, []).extend(d.new_token_ids)
    prefill = PrefillWorker(Engine(model_dir, page_size=4, chunked_prefill_size=32), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
    assert run_pair(prefill, decoder, prompts, params) == expect
    assert decoder.take_failures() == [] and prefill.take_failures() == []
    for worker in (prefill, decoder):
        stats = worker.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
        assert worker.extra_stats()["disagg_transfers_ok_total"] == len(prompts)
    prefill.close()
    decoder.close()


def test_handshake_rejects_other_dtype_with_clear_message(base_model):
    model_dir, _ = base_model
    ctx = zmq.Context()
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, dtype="bfloat16", page_size=4), config("decode"), ctx)
    got = run_pair(prefill, decoder, [list(range(3, 20))], SamplingParams(max_tokens=4, temperature=0), timeout=5)
    failures = decoder.take_failures()
    assert got == {}
    assert len(failures) == 1 and "dtype" in failures[0][1] and "float32" in failures[0][1] and "bfloat16" in failures[0][1]
    assert decoder.stats().kv_pages_used == 0 and decoder.stats().mamba_slots_used == 0
    prefill.close()
    decoder.close()


def test_lost_prefill_worker_fails_pending_rooms_and_frees(base_model):
    model_dir, _ = base_model
    ctx = zmq.Context()
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode", lease_timeout_s=0.6, transfer_timeout_s=30), ctx)
    dead = ctx.socket(zmq.ROUTER)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    dead.close(linger=0)  # nobody answers there any more
    decoder.add_request("r0", list(range(3, 30)), SamplingParams(max_tokens=4), room="room0", prefill_addr=f"tcp://127.0.0.1:{port}")
    assert decoder.stats().kv_pages_used > 0
    start = time.time()
    while decoder.has_unfinished_requests() and time.time() - start < 5:
        decoder.step()
        time.sleep(0.02)
    failures = decoder.take_failures()
    assert failures and "stopped answering" in failures[0][1]
    assert time.time() - start < 3
    assert decoder.stats().kv_pages_used == 0 and decoder.stats().mamba_slots_used == 0
    decoder.close()
