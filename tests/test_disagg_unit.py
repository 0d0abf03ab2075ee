"""Disaggregation without HTTP: protocol schemas and the prefill/decode workers in one process."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import zmq

from baton import SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.messages import (
    Abort,
    Heartbeat,
    PagesChunk,
    SlotChunk,
    StateTransfer,
    TensorSpec,
)
from baton.disagg.prefill import PrefillWorker
from baton.disagg.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
)
from baton.disagg.rooms import DisaggConfig
from baton.engine.core.engine import Engine
from tests.same_outputs import assert_same_tokens_and_logprobs, chosen


def config(role, **overrides):
    values = dict(
        role=role,
        host="127.0.0.1",
        port=0,
        secret=b"s3cret",
        bootstrap_timeout_s=5.0,
        transfer_timeout_s=5.0,
        heartbeat_interval_s=0.2,
        # Longer than any step of these tests on a loaded 2-core machine: a peer that goes away
        # is caught by its dropped connection, and the tests of the lease set their own.
        lease_timeout_s=10.0,
        max_rooms_per_peer=64,
        transfer_backend="zmq",
    )
    values.update(overrides)
    return DisaggConfig(**values)


def test_messages_round_trip_with_tensors_and_mac():
    message = PagesChunk(
        room="r",
        first_page=2,
        tensors=[TensorSpec(name="attention.k#0", dtype="bfloat16", shape=[2, 3])],
    )
    tensor = torch.randn(2, 3).bfloat16()
    frames = [bytes(f) for f in encode(message, [tensor], secret=b"k")]
    decoded, tensors = decode(frames, secret=b"k")
    assert decoded == message and torch.equal(tensors["attention.k#0"], tensor)
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

    bad = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "type": "abort",
            "ts": time.time(),
            "nonce": bytes(16),
            "body": {"room": "r", "reason": "x", "extra": 1},
        }
    )
    with pytest.raises(ProtocolError, match="fields"):
        decode([bad, b""])


def assert_pools_empty(*workers) -> None:
    for worker in workers:
        stats = worker.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0, worker


def colocated_tokens(engine, prompts, params) -> dict[str, list[int]]:
    """Request id ("r0", "r1", ...) -> tokens, all prompts run together on one engine."""
    expect: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            expect.setdefault(d.request_id, []).extend(d.new_token_ids)
    return expect


def run_pair(prefill, decoder, prompts, params, timeout=20.0, registered_first=False):
    """registered_first: let every Register reach the prefill worker before it computes (the
    usual order in production, where the router contacts the decode worker first)."""
    got = {}
    for i, prompt in enumerate(prompts):
        decoder.add_request(f"r{i}", prompt, params, room=f"room{i}", prefill_addr=prefill.address)
        prefill.add_request(f"r{i}", prompt, params, room=f"room{i}")
    start = time.time()
    while registered_first and any(r.peer is None for r in prefill.rooms.values()):
        assert time.time() - start < timeout, "registrations never arrived"
        decoder.poll()
        decoder.step()
        prefill.poll()
    while (
        decoder.has_unfinished_requests() or prefill.has_unfinished_requests()
    ) and time.time() - start < timeout:
        prefill.step()
        for delta in decoder.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return got


@pytest.mark.parametrize("one_layer_messages", [False, True])
def test_pair_is_token_identical_to_colocated_and_frees_everything(
    base_model, monkeypatch, one_layer_messages
):
    """one_layer_messages: every K/V push carries one page and every Mamba push one layer, so a
    room's state crosses in many messages, of which only the last of each batch is tracked."""
    model_dir, _ = base_model
    if one_layer_messages:
        monkeypatch.setattr("baton.disagg.prefill_sends.PUSH_BYTES", 1)
        monkeypatch.setattr("baton.disagg.prefill_sends.SLOT_PUSH_BYTES", 1)
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (1, 6, 45, 130)]
    colocated = Engine(model_dir, page_size=4)
    expect = colocated_tokens(colocated, prompts, params)
    prefill = PrefillWorker(
        Engine(model_dir, page_size=4, chunked_prefill_size=32), config("prefill"), ctx
    )
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
    installed_pages = []
    handover = decoder.engine.handover
    install_pages = handover.install_pages

    def counting_install_pages(request_id, first_page, pages):
        n = pages["attention.k"][0].shape[0]
        installed_pages.extend((request_id, first_page + i) for i in range(n))
        return install_pages(request_id, first_page, pages)

    handover.install_pages = counting_install_pages
    installed_layers = []
    install_unit = handover.install_unit

    def counting_install_unit(request_id, unit, frames):
        installed_layers.append((request_id, unit.frames[0][2]))
        return install_unit(request_id, unit, frames)

    handover.install_unit = counting_install_unit
    got = run_pair(prefill, decoder, prompts, params, registered_first=one_layer_messages)
    assert got == expect
    assert decoder.take_failures() == [] and prefill.take_failures() == []
    if one_layer_messages:  # every room was registered in time: its state was pushed
        layers = decoder.engine.cache.pools["mamba2.conv"].shape[0]
        assert sorted(installed_layers) == sorted(
            (f"r{i}", layer) for i in range(len(prompts)) for layer in range(layers)
        )
        assert prefill.counters.kv_chunks >= sum(-(-len(p) // 4) for p in prompts)
    # The 130-token prompt prefills in 32-token chunks: its pages streamed ahead of the state.
    assert prefill.counters.kv_chunks >= 3
    # ... and each page crossed the wire exactly once (the final message carries only the rest).
    assert sorted(installed_pages) == sorted(
        (f"r{i}", page) for i, p in enumerate(prompts) for page in range(-(-len(p) // 4))
    )
    assert_pools_empty(prefill, decoder)
    for worker in (prefill, decoder):
        extra = worker.extra_stats()
        assert extra["disagg_transfers_ok_total"] == len(prompts)
        assert extra["disagg_transfer_latency_le_inf"] == len(prompts)  # one latency each
    prefill.close()
    decoder.close()


@pytest.mark.parametrize("name", ["odd", "mamba_only", "attention_only"])
def test_pair_is_token_identical_for_other_model_shapes(tiny_models, name):
    """Odd head and state sizes, and models with no attention layer (no K/V pages to move) or
    no Mamba layer (no state to move): the handover carries what there is, whether the decode
    side registers before the prefill runs (pushed from the pools) or after (a snapshot)."""
    model_dir, _ = tiny_models(name)
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(5, 100)), [7]]
    expect = colocated_tokens(Engine(model_dir, page_size=4), prompts, params)
    for registered_first in (False, True):
        prefill = PrefillWorker(
            Engine(model_dir, page_size=4, chunked_prefill_size=32), config("prefill"), ctx
        )
        decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
        try:
            got = run_pair(prefill, decoder, prompts, params, registered_first=registered_first)
            assert got == expect, registered_first
            assert decoder.take_failures() == [] and prefill.take_failures() == []
            assert_pools_empty(prefill, decoder)
        finally:
            prefill.close()
            decoder.close()


def test_seeded_sampling_is_the_same_with_and_without_disaggregation(base_model):
    """A seeded request draws its noise from its own generator. The prefill engine drew the
    first token's; the decode engine skips that draw on install, so every later token is the
    one a single engine would have drawn (and reruns repeat, as users of `seed` expect)."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(5, 100)), [7]]
    expect = colocated_tokens(Engine(model_dir, page_size=4), prompts, params)
    for registered_first in (False, True):
        prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
        decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
        try:
            got = run_pair(prefill, decoder, prompts, params, registered_first=registered_first)
            assert got == expect, registered_first
        finally:
            prefill.close()
            decoder.close()


def test_min_tokens_holds_for_the_first_token_too(base_model):
    """The prefill engine samples the first token: it must ban EOS and the stop tokens for it
    as one engine does while fewer than min_tokens were generated."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    prompts = [list(range(3, 40)), list(range(5, 100))]
    greedy = SamplingParams(max_tokens=1, temperature=0)
    firsts = colocated_tokens(Engine(model_dir, page_size=4), prompts, greedy)
    # Each prompt's unconstrained first token becomes a stop token it may not use yet.
    params = SamplingParams(
        max_tokens=6,
        temperature=0,
        min_tokens=3,
        stop_token_ids=[firsts["r0"][0], firsts["r1"][0]],
    )
    expect = colocated_tokens(Engine(model_dir, page_size=4), prompts, params)
    assert all(expect[f"r{i}"][0] != firsts[f"r{i}"][0] for i in range(2))
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
    try:
        assert run_pair(prefill, decoder, prompts, params) == expect
    finally:
        prefill.close()
        decoder.close()


def test_handshake_rejects_other_dtype_with_clear_message(base_model):
    model_dir, _ = base_model
    ctx = zmq.Context()
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, dtype="bfloat16", page_size=4), config("decode"), ctx)
    got = run_pair(
        prefill,
        decoder,
        [list(range(3, 20))],
        SamplingParams(max_tokens=4, temperature=0),
        timeout=5,
    )
    failures = decoder.take_failures()
    assert got == {}
    assert (
        len(failures) == 1
        and "dtype" in failures[0][1]
        and "float32" in failures[0][1]
        and "bfloat16" in failures[0][1]
    )
    assert decoder.stats().kv_pages_used == 0 and decoder.stats().mamba_slots_used == 0
    prefill.close()
    decoder.close()


def test_lost_prefill_worker_fails_pending_rooms_and_frees(base_model):
    model_dir, _ = base_model
    ctx = zmq.Context()
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4),
        config("decode", lease_timeout_s=0.6, transfer_timeout_s=30),
        ctx,
    )
    dead = ctx.socket(zmq.ROUTER)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    dead.close(linger=0)  # nobody answers there any more
    decoder.add_request(
        "r0",
        list(range(3, 30)),
        SamplingParams(max_tokens=4),
        room="room0",
        prefill_addr=f"tcp://127.0.0.1:{port}",
    )
    assert decoder.stats().kv_pages_used > 0
    start = time.time()
    while decoder.has_unfinished_requests() and time.time() - start < 5:
        decoder.step()
        time.sleep(0.02)
    failures = decoder.take_failures()
    assert failures and "never answered (is it running" in failures[0][1]
    assert time.time() - start < 3
    assert decoder.stats().kv_pages_used == 0 and decoder.stats().mamba_slots_used == 0
    decoder.close()


def test_a_prefill_worker_that_goes_away_fails_its_rooms_by_the_dropped_connection(base_model):
    """The lease is long (it must outlast the slowest step of a busy prefill worker); a prefill
    worker whose process goes away is noticed by its connection, at once."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4), config("decode", lease_timeout_s=60.0), ctx
    )
    decoder.add_request(
        "r0", list(range(3, 30)), params, room="room0", prefill_addr=prefill.address
    )
    prefill.add_request("r0", list(range(3, 30)), params, room="room0")  # never stepped
    start = time.time()
    while prefill.rooms["room0"].peer is None:  # registered: the connection is up
        assert time.time() - start < 10, "the Register never arrived"
        decoder.step()
        prefill.poll()
    prefill.close()  # the prefill worker's socket goes away before it sends anything
    start = time.time()
    while decoder.has_unfinished_requests() and time.time() - start < 10:
        decoder.step()
        time.sleep(0.02)
    (failure,) = decoder.take_failures()
    assert failure[0] == "r0" and failure[1].endswith("(connection lost)")
    assert time.time() - start < 5  # the connection, not the 60 s lease
    assert_pools_empty(decoder)
    decoder.close()


def collect(prefill, decoder, items, params, timeout=30.0):
    """items: (request_id, prompt); returns request_id -> (tokens, num_cached_tokens, logprob of
    each token)."""
    got: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    cached: dict[str, int] = {}
    for rid, prompt in items:
        decoder.add_request(rid, prompt, params, room=f"room-{rid}", prefill_addr=prefill.address)
        prefill.add_request(rid, prompt, params, room=f"room-{rid}")
    start = time.time()
    while (
        decoder.has_unfinished_requests() or prefill.has_unfinished_requests()
    ) and time.time() - start < timeout:
        prefill.step()
        for delta in decoder.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            logprobs.setdefault(delta.request_id, []).extend(
                chosen(delta.new_token_ids, delta.new_logprobs)
            )
            cached[delta.request_id] = delta.num_cached_tokens
    assert decoder.take_failures() == []
    return {rid: (got[rid], cached[rid], logprobs[rid]) for rid, _ in items}


def test_both_workers_reuse_cached_prefixes_and_stay_token_identical(base_model):
    """Shared few-shot prefixes hit the prefill worker's cache; the decode worker caches the
    transferred block checkpoints, so a second chat turn (prompt + answer + more) skips the
    pages it already holds. Outputs equal a colocated run with the cache off."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    args = dict(page_size=4, mamba_track_interval=32, chunked_prefill_size=48)
    prefill = PrefillWorker(Engine(model_dir, **args), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, **args), config("decode"), ctx)
    reference = Engine(model_dir, page_size=4, enable_prefix_caching=False)

    def same_as_colocated(result, prompt, where):
        reference.add_request("ref", prompt, params)
        tokens, logprobs = [], []
        while reference.has_unfinished_requests():
            for delta in reference.step():
                tokens.extend(delta.new_token_ids)
                logprobs.extend(chosen(delta.new_token_ids, delta.new_logprobs))
        assert_same_tokens_and_logprobs(result[0], result[2], tokens, logprobs, where)

    shared = [(5 * j) % 290 + 3 for j in range(150)]
    questions = [shared + [(11 * i + j) % 290 + 3 for j in range(10 + i)] for i in range(4)]
    first = collect(prefill, decoder, [("q0", questions[0])], params)
    rest = collect(prefill, decoder, [(f"q{i}", q) for i, q in enumerate(questions[1:], 1)], params)
    results = first | rest
    for i, q in enumerate(questions):
        same_as_colocated(results[f"q{i}"], q, f"question {i}")
    assert (
        prefill.engine.stats().prefix_cache_hit_tokens >= 3 * 128
    )  # prefill reused the shared prefix
    assert all(results[f"q{i}"][1] >= 128 for i in range(1, 4))  # decode matched its own blocks

    # Second turn of a chat: the decode worker already holds turn one's prompt blocks and the
    # blocks its own decode checkpointed.
    turn2 = questions[0] + results["q0"][0] + [17, 18, 19]
    bytes_before = decoder.counters.bytes_total
    second = collect(prefill, decoder, [("turn2", turn2)], params)
    same_as_colocated(second["turn2"], turn2, "second turn")
    # Turn one's prompt (150 tokens) has 4 blocks; the 5th (to 160) was checkpointed by the
    # decode worker's own decode steps.
    assert second["turn2"][1] >= 160 and decoder.engine.stats().mamba_checkpoints_decode > 0
    full_pages = -(-len(turn2) // 4)
    sent = decoder.counters.bytes_total - bytes_before
    per_page = (
        2
        * len(prefill.engine.cache.pools["attention.k"])
        * 4
        * prefill.engine.cache.pools["attention.k"][0].shape[1]
        * prefill.engine.cache.pools["attention.k"][0].shape[2]
        * 4
    )
    assert sent < full_pages * per_page  # the cached pages were not sent again
    assert_pools_empty(prefill, decoder)
    prefill.close()
    decoder.close()


def test_mamba_state_pushed_ahead_and_a_lost_part_fails_cleanly(base_model, monkeypatch):
    """A registered decode side gets the final Mamba state in SlotChunks ahead of the
    StateTransfer (which then carries no layers); if one of them never arrives, the room
    fails with a message naming it and both pools return to zero."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(5, 60))]
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
    colocated = Engine(model_dir, page_size=4)
    expect = colocated_tokens(colocated, prompts, params)
    sent = []
    send = prefill.socket.send_multipart

    def spy(frames, *args, **kwargs):
        sent.append(decode(frames[1:])[0])
        return send(frames, *args, **kwargs)

    monkeypatch.setattr(prefill.socket, "send_multipart", spy)
    assert run_pair(prefill, decoder, prompts, params, registered_first=True) == expect
    finals = [m for m in sent if isinstance(m, StateTransfer)]
    slot_frames = [
        [s for s in m.tensors if s.name.startswith("slots/")] for m in finals
    ]  # every slot tensor with no layers: they came ahead
    assert len(finals) == 2 and all(s.shape[0] == 0 for f in slot_frames for s in f)
    assert all(len(f) == 2 for f in slot_frames)
    assert sum(isinstance(m, SlotChunk) for m in sent) >= 2
    # Now lose the slot-state push of the next request.
    monkeypatch.setattr(prefill.sender, "push_slots", lambda r, req: None)
    got = run_pair(prefill, decoder, [prompts[0]], params, timeout=10, registered_first=True)
    assert got == {}
    failures = decoder.take_failures()
    assert len(failures) == 1 and "slot state incomplete: 0 of" in failures[0][1]
    assert_pools_empty(prefill, decoder)
    prefill.close()
    decoder.close()


class Hold:
    def __init__(self):
        self.done = False


def test_held_pages_and_slot_outlive_the_request_until_the_hold_is_done(base_model):
    """A zero-copy send reads the pool in place: a finished (or aborted) request whose hold is
    not done keeps its pages and slot out of the free lists, so no new request can overwrite
    them, and gives them back on the first step after the hold is done."""
    model_dir, _ = base_model
    engine = Engine(model_dir, page_size=4)
    prompt = list(range(3, 40))  # 37 tokens: 10 pages of 4
    holds = {"finished": Hold(), "aborted": Hold()}
    for rid, hold in holds.items():
        max_tokens = 1 if rid == "finished" else 4
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.requests[rid].hold = hold
    engine.step()  # both prefill; "finished" samples its one token and finishes
    assert "finished" not in engine.requests
    held_pages = set(engine.requests["aborted"].kv_pages)
    engine.abort_request("aborted")
    assert engine.stats().kv_pages_used == 20 and engine.stats().mamba_slots_used == 2
    engine.add_request("next", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert not held_pages & set(engine.requests["next"].kv_pages)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_pages_used == 20
    holds["finished"].done = True
    engine.step()  # nothing to run: the step still gives back what is no longer held
    assert engine.stats().kv_pages_used == 10 and engine.stats().mamba_slots_used == 1
    holds["aborted"].done = True
    engine.step()
    assert engine.stats().kv_pages_used == 0 and engine.stats().mamba_slots_used == 0


def test_a_preempted_request_keeps_its_hold_for_the_pages_it_writes_after(base_model):
    """A disaggregated prefill streams pages while it computes, so a request preempted midway
    and run again still has sends reading its pages in place: the hold guards the pages of its
    second run too, not only those it had when it was preempted."""
    model_dir, _ = base_model
    engine = Engine(model_dir, page_size=4, chunked_prefill_size=16, max_num_batched_tokens=16)
    hold = Hold()
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.requests["a"].hold = hold
    engine.step()  # 16 of 37 prompt tokens
    req = engine.requests["a"]
    engine.scheduler.preempt(req)
    assert engine.stats().kv_pages_used == 4  # parked with the hold, not freed
    while engine.has_unfinished_requests():
        engine.step()
    assert "a" not in engine.requests
    assert engine.stats().kv_pages_used == 4 + 10 and engine.stats().mamba_slots_used == 2
    hold.done = True
    engine.step()
    assert engine.stats().kv_pages_used == 0 and engine.stats().mamba_slots_used == 0


def test_pages_freed_as_a_run_come_back_as_a_run():
    from baton.engine.cache.memory import IndexPool

    pool = IndexPool(16, "pages")
    first = pool.alloc(5)
    assert first == [1, 2, 3, 4, 5]
    pool.alloc(2)
    pool.free(first)
    assert pool.alloc(5) == first  # one slice to copy and one frame to send, not five


def test_other_protocol_version_is_rejected_by_name():
    import msgpack

    old = PROTOCOL_VERSION - 1
    header = msgpack.packb({"v": old, "type": "abort", "body": {"room": "r", "reason": "x"}})
    with pytest.raises(ProtocolError, match=f"protocol {old}, this worker {PROTOCOL_VERSION}"):
        decode([header, b""])


def test_install_pages_puts_each_page_where_the_request_has_it(base_model):
    """Pages that span a contiguous range out of order (3, 5, 4, 6) are not one run: each
    streamed page must land in its own pool page, as with any scattered allocation."""
    model_dir, _ = base_model
    engine = Engine(model_dir, page_size=4)
    engine.handover.preallocate("r", list(range(3, 19)), SamplingParams(max_tokens=2))
    req = engine.requests["r"]
    first = min(req.kv_pages)
    for order in ([0, 2, 1, 3], [0, 1, 2, 3], [3, 0, 1, 2]):
        req.kv_pages = [first + i for i in order]
        n, ps = 4, engine.cache.page_size
        k = [torch.randn(n, ps, *pool.shape[1:]) for pool in engine.cache.pools["attention.k"]]
        v = [torch.randn(n, ps, *pool.shape[1:]) for pool in engine.cache.pools["attention.v"]]
        engine.handover.install_pages("r", 0, {"attention.k": k, "attention.v": v})
        for pools, sent in (
            (engine.cache.pools["attention.k"], k),
            (engine.cache.pools["attention.v"], v),
        ):
            for pool, src in zip(pools, sent):
                for i, page in enumerate(req.kv_pages):
                    assert torch.equal(pool[page * ps : (page + 1) * ps], src[i]), (order, i)


class StuckSend:
    """A zero-copy send ZMQ never gets to write: the decode worker stopped reading."""

    done = False


def test_sends_a_decode_worker_never_reads_free_the_pages_after_its_timeout(
    base_model, monkeypatch
):
    """A decode worker that stops reading while its connection stays up (hung, or its socket
    full) must not keep the prefill worker's pages and slot forever: they come back once its
    transfer timeout (sent in Register) and a grace period have passed, and the decode worker,
    reading again, installs nothing of what it gets after that timeout (those frames may hold
    another request's state by then): the room fails and both pools return to zero."""
    import baton.disagg.prefill

    monkeypatch.setattr(baton.disagg.prefill, "HOLD_GRACE_S", 0.2)
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(3, 40))
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4), config("decode", transfer_timeout_s=2.0), ctx
    )
    decoder.add_request("r0", prompt, params, room="room0", prefill_addr=prefill.address)
    prefill.add_request("r0", prompt, params, room="room0")
    room = prefill.rooms["room0"]
    start = time.monotonic()
    while room.peer is None:
        assert time.monotonic() - start < 10, "the Register never arrived"
        prefill.socket.poll(10)
        prefill.poll()
    room.sends.add(StuckSend())
    deadline = room.sends.deadline  # registration + 2 s + the grace
    while prefill.engine.has_unfinished_requests() or prefill.rooms:
        prefill.step()
    assert time.monotonic() < deadline, "the prefill took longer than the whole timeout"
    assert prefill.stats().kv_pages_used == 10 and prefill.stats().mamba_slots_used == 1
    while time.monotonic() < deadline - 0.3:  # within the decode side's timeout: still held
        prefill.step()
        time.sleep(0.05)
    assert prefill.engine.handover.has_held() and prefill.stats().kv_pages_used == 10
    while prefill.has_unfinished_requests():
        assert time.monotonic() - start < 5, "held pages were never given back"
        prefill.step()
        time.sleep(0.05)
    assert prefill.stats().kv_pages_used == 0 and prefill.stats().mamba_slots_used == 0
    assert prefill.extra_stats()["disagg_holds_expired_total"] == 1
    got = []
    while decoder.has_unfinished_requests():
        got += decoder.step()
    assert got == []
    (failure,) = decoder.take_failures()
    assert failure[0] == "r0" and "after the transfer timeout (2 s)" in failure[1]
    assert decoder.stats().kv_pages_used == 0 and decoder.stats().mamba_slots_used == 0
    assert decoder.counters.bytes_total == 0  # nothing installed
    prefill.close()
    decoder.close()


def test_worker_loop_reports_freed_pages_after_a_peer_fails_a_room(base_model):
    """A room failed by a peer message (here a Reject) while the worker has nothing else to do:
    the loop reports the failure *and* stats with the pages and slot back, without waiting for
    anything else to happen (the server's /metrics reads those stats)."""
    import os
    import threading

    from baton.disagg.messages import (
        Register,
        Reject,
    )
    from baton.disagg.process import DisaggEngineLoop
    from baton.engine.runtime import ipc

    model_dir, _ = base_model
    ctx = zmq.Context()
    to_engine, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind("inproc://loop-in")
    inbox.connect("inproc://loop-in")
    from_engine.bind("inproc://loop-out")
    outbox.connect("inproc://loop-out")
    fake_prefill = ctx.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{fake_prefill.bind_to_random_port('tcp://127.0.0.1')}"
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode"), ctx)
    loop = DisaggEngineLoop(decoder, inbox, outbox, os.getppid())
    thread = threading.Thread(target=loop.run)
    thread.start()

    def receive():
        assert from_engine.poll(5000), "the loop sent nothing within 5 s"
        return ipc.decode(from_engine.recv())

    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        to_engine.send(
            ipc.encode(
                ipc.AddRequest(
                    request_id="r0",
                    prompt_token_ids=list(range(3, 40)),
                    params=params,
                    room="room0",
                    prefill_addr=address,
                )
            )
        )
        while receive().stats["kv_pages_used"] == 0:
            pass
        assert fake_prefill.poll(5000)
        identity, *frames = fake_prefill.recv_multipart()
        assert isinstance(decode(frames, b"s3cret")[0], Register)
        reject = Reject(room="room0", message="incompatible workers: test")
        fake_prefill.send_multipart([identity, *encode(reject, secret=b"s3cret")])
        messages = [receive()]
        while not (
            isinstance(messages[-1], ipc.StepOutput) and messages[-1].stats["kv_pages_used"] == 0
        ):
            messages.append(receive())
        failed = [m for m in messages if isinstance(m, ipc.RequestFailed)]
        assert [m.request_id for m in failed] == ["r0"] and "test" in failed[0].message
        assert messages[-1].stats["mamba_slots_used"] == 0
    finally:
        to_engine.send(ipc.encode(ipc.Shutdown()))
        thread.join(10)
        decoder.close()
        for socket in (to_engine, inbox, outbox, from_engine, fake_prefill):
            socket.close(linger=0)


def test_decode_worker_queues_rooms_its_pools_cannot_hold_yet(base_model):
    """More rooms than the decode pools hold at once: the rest wait (oldest first) and register
    as pages and slots come back, instead of failing (as a colocated engine queues requests).
    Every output stays token-identical, preemptions on the decode side included."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(60 + 10 * i)] for i in range(6)]
    expect = colocated_tokens(Engine(model_dir, page_size=4), prompts, params)
    # Queued rooms wait as long as the prefill of those ahead takes: several seconds when this
    # 2-core machine is loaded, so the bootstrap timeout here is generous.
    slow = dict(bootstrap_timeout_s=60.0, transfer_timeout_s=60.0)
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill", **slow), ctx)
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4, max_total_tokens=400), config("decode", **slow), ctx
    )
    try:
        for i, prompt in enumerate(prompts):
            decoder.add_request(
                f"r{i}", prompt, params, room=f"room{i}", prefill_addr=prefill.address
            )
        waiting = decoder.extra_stats()["disagg_rooms_bootstrapping"]
        assert 0 < waiting < len(prompts) and len(decoder.rooms) == len(prompts) - waiting
        for i, prompt in enumerate(prompts):
            prefill.add_request(f"r{i}", prompt, params, room=f"room{i}")
        got = run_pair(prefill, decoder, [], params, timeout=60)
        assert got == expect and decoder.take_failures() == []
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()


def test_a_room_that_never_fits_in_time_fails_with_a_clear_message(base_model):
    model_dir, _ = base_model
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4, max_total_tokens=200),
        config("decode", bootstrap_timeout_s=0.5),
        ctx,
    )
    try:
        for i in range(2):  # the first holds most of the pool; its prefill never comes
            prompt = list(range(3, 130 + i))
            decoder.add_request(
                f"r{i}", prompt, params, room=f"room{i}", prefill_addr=prefill.address
            )
        assert list(decoder.rooms) == ["room0"] and len(decoder.queued) == 1
        start = time.monotonic()
        while not decoder.failures:
            assert time.monotonic() - start < 5
            decoder.step()
            time.sleep(0.02)
        (failure,) = decoder.take_failures()
        assert failure[0] == "r1" and "no free KV pages or Mamba slot" in failure[1]
        assert "within 0.5 s" in failure[1] and not decoder.queued
        assert list(decoder.rooms) == ["room0"]  # the registered room still waits for its state
        decoder.abort_request("r0")
        assert decoder.stats().kv_pages_used == 0 and decoder.stats().mamba_slots_used == 0
    finally:
        prefill.close()
        decoder.close()


def test_a_prefill_worker_with_another_secret_is_named_as_the_likely_cause(base_model):
    """Messages under another --disagg-secret are dropped unread on both sides, so nothing can
    say "wrong secret" over the wire; the decode side's timeout says what to check instead."""
    model_dir, _ = base_model
    ctx = zmq.Context()
    prefill = PrefillWorker(Engine(model_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4),
        config("decode", secret=b"other", transfer_timeout_s=0.5),
        ctx,
    )
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        decoder.add_request("r0", [5, 6, 7], params, room="room0", prefill_addr=prefill.address)
        prefill.add_request("r0", [5, 6, 7], params, room="room0")
        start = time.monotonic()
        while not decoder.failures:
            assert time.monotonic() - start < 5
            prefill.step()
            decoder.step()
            time.sleep(0.02)
        (failure,) = decoder.take_failures()
        assert "never answered" in failure[1] and "--disagg-secret" in failure[1]
        assert decoder.stats().kv_pages_used == 0
    finally:
        prefill.close()
        decoder.close()
