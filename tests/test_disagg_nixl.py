"""The nixl transfer backend in process: a pair whose decode worker READs each room's state
from the prefill worker's pools gives the tokens and logprobs of a colocated engine and of the
zmq backend, for NemotronH, gated DeltaNet, Mamba1 + MoE, NemotronH MoE with its MTP head
drafting, and a model without attention, through prefix caches on both sides; a forged offer,
a read stuck past its deadline and a peer gone mid-read fail only their request, with every
page and slot back on both sides and the next request served as before. Gated DeltaNet and
Mamba1 pairs at TP 1:2 and 2:1 read rank to rank (NemotronH's and the TP faults: in
tests/test_disagg_tp.py, whose harness serves here too).

UCX over TCP on loopback here (tests/test_disagg_nixl_up.py runs two processes over TCP and
over shared memory). Skipped only where NIXL is not installed, and never when
BATON_REQUIRE_NIXL is set (`make test` sets it: `make install` installs baton[nixl]).
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import zmq

from baton import SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.messages import ReadOffer
from baton.disagg.nixl_transfer import check_regions, plan_read, region_of
from baton.disagg.prefill import PrefillWorker
from baton.disagg.rooms import FaultInjection
from baton.engine.core.engine import Engine
from baton.engine.handover.state import StatePlace
from tests.mtp_models import add_mtp_layer
from tests.nixl_required import needs_nixl
from tests.same_outputs import assert_same_tokens_and_logprobs
from tests.test_disagg_families import Run, assert_as_colocated, chunk_size
from tests.test_disagg_tp import colocated_tokens, run_pair, tp_workers
from tests.test_disagg_tp import settle as settle_pair
from tests.test_disagg_unit import assert_pools_empty, config

SLOW_OK = dict(bootstrap_timeout_s=60.0, transfer_timeout_s=60.0)
NO_FAULTS = FaultInjection(drop_probability=0.0, delay_ms=0, stall_reads=False)


@pytest.fixture(autouse=True)
def ucx_over_tcp(monkeypatch):
    """UCX's transports are read when an agent starts: TCP on loopback for these pairs."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")


def pair(model_dir, backend: str, prefill_args: dict, decode_args: dict, **timeouts) -> Run:
    ctx = zmq.Context()
    options = SLOW_OK | timeouts
    prefill = PrefillWorker(
        Engine(model_dir, **prefill_args),
        config("prefill", transfer_backend=backend, **options),
        ctx,
        faults=NO_FAULTS,
    )
    decoder = DecodeWorker(
        Engine(model_dir, **decode_args),
        config("decode", transfer_backend=backend, **options),
        ctx,
        faults=NO_FAULTS,
    )
    return Run(prefill, decoder)


def close(*runs: Run) -> None:
    for run in runs:
        run.prefill.close()
        run.decoder.close()


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def settle(run: Run, seconds: float = 0.5) -> None:
    """Step both sides a moment (ReadDone and Abort reach the prefill side between steps)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        run.prefill.step()
        run.decoder.step()


# -- token-identical through the pair --------------------------------------------------------


# (NemotronH MoE with its MTP head: test_mtp_speculation_over_nixl_matches_colocated)
FAMILIES = [
    ("tiny", "odd"),  # NemotronH: attention first, one KV head, three groups, conv 3
    ("gdn", "qwen3_next_mixed"),  # gated DeltaNet + gated attention
    ("ssm", "jamba_moe"),  # Mamba1 + attention + MoE
    ("tiny", "mamba_only"),  # no attention: nothing but slot state and checkpoints
    # sliding beside full attention: two page tables interleaved in one page list, the
    # sliding pool inside the full one (regions that overlap)
    ("window", "lfm3_mixed"),
]
# The zmq pair beside the nixl one (tests/test_disagg_families.py proves zmq equal to colocated
# for every family; once here is the direct comparison, kept to one family for the time)
BESIDE_ZMQ = {"odd"}


@needs_nixl
@pytest.mark.parametrize(("where", "name"), FAMILIES, ids=[n for _, n in FAMILIES])
def test_nixl_pair_matches_colocated_and_zmq_through_prefix_hits_on_both_sides(
    where, name, tiny_models, gdn_models, ssm_models, window_models
):
    """A prompt over several blocks; then prompts sharing its prefix (the prefill side resumes
    from its checkpoints; the decode side's own blocks of the first one are not read again:
    fewer pages, later checkpoints); a first-token-only request: as colocated, and as the
    zmq backend."""
    models = {"tiny": tiny_models, "gdn": gdn_models, "ssm": ssm_models, "window": window_models}
    model_dir, hf = models[where](name)
    page = 4
    interval = math.lcm(chunk_size(model_dir), page)
    vocab = hf.config.vocab_size
    whole = random_prompt(vocab, 2 * interval + 5, seed=1)
    rounds = [
        [("long", whole), ("short", whole[:3])],
        [("again", whole + [5, 6]), ("shared", whole[:interval] + random_prompt(vocab, 9, 2))],
    ]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    cache = dict(page_size=page, mamba_track_interval=interval)
    args = (cache | dict(chunked_prefill_size=interval + 3), cache)
    nixl = pair(model_dir, "nixl", *args)
    zmq_run = pair(model_dir, "zmq", *args) if name in BESIDE_ZMQ else None
    reference = Engine(model_dir, page_size=page, enable_prefix_caching=False)
    try:
        for items in rounds:
            nixl(items, params)
            assert_as_colocated(nixl, reference, items, params)
            if zmq_run is None:
                continue
            zmq_run(items, params)
            for rid, _ in items:  # (logprobs within the batching tolerance: steps differ)
                assert_same_tokens_and_logprobs(
                    nixl.tokens[rid],
                    nixl.logprobs[rid],
                    zmq_run.tokens[rid],
                    zmq_run.logprobs[rid],
                    f"{rid}: nixl vs zmq",
                )
        assert nixl.cached["again"] >= 2 * interval  # read once, cached on the decode side
        assert nixl.prefill.stats().prefix_cache_hit_tokens >= 2 * interval
        first_only = [("first", whole[:7])]
        nixl(first_only, SamplingParams(max_tokens=1, temperature=0, logprobs=2))
        assert_as_colocated(
            nixl, reference, first_only, SamplingParams(max_tokens=1, temperature=0, logprobs=2)
        )
        settle(nixl, 0.2)
        assert_pools_empty(nixl.prefill, nixl.decoder)
        decode_counts, prefill_counts = nixl.decoder.counters, nixl.prefill.counters
        assert decode_counts.transfers_ok == prefill_counts.transfers_ok == 5
        # Every byte came by READ: the same count on both sides, none as frames.
        assert decode_counts.bytes_total == prefill_counts.bytes_total > 0
        assert prefill_counts.kv_chunks == 0 and decode_counts.transfer_seconds_sum > 0
        stats = nixl.decoder.extra_stats()
        assert stats["disagg_backend_transfers_total:nixl"] == 5
    finally:
        close(nixl, *([zmq_run] if zmq_run else []))


@needs_nixl
def test_mtp_speculation_over_nixl_matches_colocated(tiny_models, tmp_path):
    """The MTP head's K/V and last hidden state are state-spec tensors like any other: read
    with the rest, the decode worker drafts as a colocated engine does."""
    source, _ = tiny_models("moe_nano")
    add_mtp_layer(source, tmp_path / "mtp", ["full_attention", "moe"])
    model_dir = tmp_path / "mtp"
    spec = dict(
        page_size=4,
        mamba_track_interval=16,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    items = [("long", [(7 * i) % 300 + 3 for i in range(41)]), ("short", [5, 9, 14])]
    run = pair(model_dir, "nixl", spec | dict(chunked_prefill_size=11), spec)
    try:
        run(items, params)
        assert_as_colocated(run, Engine(model_dir, **spec), items, params)
        assert run.decoder.engine.stats().spec_decode_num_drafts > 0
        settle(run, 0.2)
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)


# -- across tensor-parallel sizes -------------------------------------------------------------

# NemotronH at 1:2, 2:1, 2:2 and the TP faults: tests/test_disagg_tp.py (its harness serves here)
TP_FAMILIES = [
    ("gdn", "qwen3_next_moe"),  # gated DeltaNet: packed q | k | v conv channels, MoE
    ("ssm", "jamba_moe"),  # Mamba1 + attention + MoE
]


@needs_nixl
@pytest.mark.parametrize(("where", "name"), TP_FAMILIES, ids=[n for _, n in TP_FAMILIES])
def test_nixl_tp_pairs_match_colocated_through_prefix_hits(where, name, gdn_models, ssm_models):
    """Prefill:decode at TP 1:2 and 2:1 over nixl, each decode rank reading its channels and
    heads of each prefill rank's pools: a first round, then prompts extending it (both sides
    resume from their checkpoints, the decode side reads only the blocks it lacks): the tokens
    of a colocated TP=1 engine, so those of the zmq pairs (tests/test_gdn_serving.py,
    tests/test_ssm_tp.py), with every page and slot back on both sides."""
    model_dir, hf = {"gdn": gdn_models, "ssm": ssm_models}[where](name)
    page = 4
    interval = math.lcm(chunk_size(model_dir), page)
    vocab = hf.config.vocab_size
    first = [random_prompt(vocab, n, seed=n) for n in (9, 2 * interval + 5)]
    again = [p + [7, 8, 9] for p in first]
    args = dict(page_size=page, chunked_prefill_size=interval // 2, max_num_batched_tokens=interval)
    reference = Engine(model_dir, page_size=page, enable_prefix_caching=False)
    expect = [
        colocated_tokens(reference, prompts, tag) for prompts, tag in ((first, "a"), (again, "b"))
    ]
    with tp_workers(model_dir, args) as workers:
        for sizes in ((1, 2), (2, 1)):
            prefill = workers("prefill", sizes[0], interval, "nixl")
            decoder = workers("decode", sizes[1], interval, "nixl")
            cached: dict[str, int] = {}
            for prompts, tag, want in ((first, "a", expect[0]), (again, "b", expect[1])):
                got = run_pair(prefill, decoder, prompts, f"{tag}{sizes}", cached=cached)
                assert got == {f"r{i}": want[f"{tag}{i}"] for i in range(len(prompts))}, sizes
                cached_first_round, cached = cached, {}
            assert cached_first_round["r1"] >= 2 * interval  # the decode side's own blocks
            assert prefill.stats().prefix_cache_hit_tokens >= 2 * interval
            settle_pair(prefill, decoder)
            assert_pools_empty(prefill, decoder)
            assert decoder.counters.transfers_ok == prefill.counters.transfers_ok == 4


@needs_nixl
def test_mtp_speculation_over_nixl_from_tp1_to_tp2_matches_colocated(tiny_models, tmp_path):
    """The MTP head's K/V and hidden state split across the decode ranks like any state-spec
    tensor: each rank reads its slices of them, and the TP=2 decode worker drafts and verifies
    as a colocated TP=1 engine does."""
    source, _ = tiny_models("moe_nano")
    add_mtp_layer(source, tmp_path / "mtp", ["full_attention", "moe"])
    model_dir = tmp_path / "mtp"
    spec = dict(page_size=4, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompts = [[(7 * i) % 300 + 3 for i in range(41)], [5, 9, 14]]
    want = colocated_tokens(Engine(model_dir, **spec, mamba_track_interval=16), prompts, "c")
    with tp_workers(model_dir, spec | dict(chunked_prefill_size=11)) as workers:
        prefill, decoder = workers("prefill", 1, 16, "nixl"), workers("decode", 2, 16, "nixl")
        got = run_pair(prefill, decoder, prompts, "mtp")
        assert got == {f"r{i}": want[f"c{i}"] for i in range(len(prompts))}
        assert decoder.engine.stats().spec_decode_num_drafts > 0
        settle_pair(prefill, decoder)
        assert_pools_empty(prefill, decoder)


# -- refused and failed reads --------------------------------------------------------------


def serve_one(run: Run, rid: str, prompt: list[int], timeout: float = 30) -> list:
    """One request through the pair until both sides are done; the decode side's failures."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run.decoder.add_request(rid, prompt, params, room=rid, prefill_addr=run.prefill.address)
    run.prefill.add_request(rid, prompt, params, room=rid)
    start = time.monotonic()
    while run.decoder.has_unfinished_requests() or run.prefill.has_unfinished_requests():
        assert time.monotonic() - start < timeout, "the pair hung"
        run.prefill.step()
        for delta in run.decoder.step():
            run.tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    run.prefill.take_failures()
    return run.decoder.take_failures()


def forge(run: Run, change) -> None:
    """The prefill worker's next offers pass through `change` (a peer that lies)."""
    sender = run.prefill.sender
    send = sender.send_tensors

    def lying(r, message, tensors, track):
        if isinstance(message, ReadOffer):
            message = change(message)
        send(r, message, tensors, track)

    sender.send_tensors = lying


def region_with(offer: ReadOffer, **changes) -> ReadOffer:
    pools = [dataclasses.replace(offer.pools[0], **changes), *offer.pools[1:]]
    return dataclasses.replace(offer, pools=pools)


FORGERIES = {
    "page past its pool": (lambda o: dataclasses.replace(o, pages=[1 << 40, *o.pages[1:]]), "page"),
    "the dummy slot": (lambda o: dataclasses.replace(o, slot=0), "slot 0"),
    "one page short": (lambda o: dataclasses.replace(o, pages=o.pages[1:]), "pages, this request"),
    "rows of another size": (lambda o: region_with(o, row_bytes=o.pools[0].row_bytes * 2), "rows"),
    "memory it never registered": (
        lambda o: region_with(o, address=o.pools[0].address + (1 << 44)),
        "NIXL refused",
    ),
    "another agent's name": (lambda o: dataclasses.replace(o, agent="someone-else"), "agent"),
}


@needs_nixl
def test_forged_offers_fail_their_request_and_free_both_sides(tiny_models):
    """Each lie fails its own request with a message that names it, before a byte moves; the
    prefill side hears Abort and lets the held pages go; the next honest offer is read."""
    model_dir, _ = tiny_models("base")
    run = pair(model_dir, "nixl", dict(page_size=4), dict(page_size=4), transfer_timeout_s=20.0)
    prompt = list(range(3, 30))
    try:
        assert serve_one(run, "honest", prompt) == []
        for i, (what, (change, named)) in enumerate(FORGERIES.items()):
            sender_send = run.prefill.sender.send_tensors
            forge(run, change)
            ((rid, reason),) = serve_one(run, f"forged{i}", prompt)
            run.prefill.sender.send_tensors = sender_send
            assert rid == f"forged{i}" and named in reason, (what, reason)
            settle(run, 0.2)
            assert_pools_empty(run.prefill, run.decoder)
            assert not run.prefill.rooms and not run.decoder.rooms
        assert serve_one(run, "after", prompt) == []
        assert run.tokens["after"] == run.tokens["honest"]
        assert run.decoder.counters.messages_refused >= len(FORGERIES)
    finally:
        close(run)


@needs_nixl
def test_read_past_its_deadline_fails_and_frees_both_sides(tiny_models):
    """A READ that never completes (fault injection: the decode side never sees it end) fails
    its request at the transfer timeout: the read is cancelled, the prefill side's hold goes
    with the Abort, and the next request is read and served as before."""
    model_dir, _ = tiny_models("base")
    run = pair(model_dir, "nixl", dict(page_size=4), dict(page_size=4), transfer_timeout_s=1.5)
    prompt = list(range(3, 30))
    try:
        run.decoder.reader.faults = dataclasses.replace(NO_FAULTS, stall_reads=True)
        ((_, reason),) = serve_one(run, "stuck", prompt)
        assert "within 1.5 s" in reason, reason
        settle(run, 0.2)
        assert_pools_empty(run.prefill, run.decoder)
        run.decoder.reader.faults = NO_FAULTS
        assert serve_one(run, "next", prompt) == [] and len(run.tokens["next"]) == 4
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)


@needs_nixl
def test_prefill_gone_mid_read_fails_the_room_and_frees_the_decode_side(tiny_models):
    """The prefill worker closes (its process gone, as far as the decode side can tell) while
    the decode side's READ is in flight: the dropped connection fails the room, the READ is
    cancelled and the decode side's pages and slot come back."""
    model_dir, _ = tiny_models("base")
    run = pair(model_dir, "nixl", dict(page_size=4), dict(page_size=4))
    run.decoder.reader.faults = dataclasses.replace(NO_FAULTS, stall_reads=True)
    prompt = list(range(3, 30))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        run.decoder.add_request("r", prompt, params, room="r", prefill_addr=run.prefill.address)
        run.prefill.add_request("r", prompt, params, room="r")
        start = time.monotonic()
        while not run.decoder.reader.reads:
            assert time.monotonic() - start < 30, "the read never started"
            run.prefill.step()
            run.decoder.step()
        assert run.decoder.stats().kv_pages_used > 0
        run.prefill.close()
        while run.decoder.has_unfinished_requests():
            assert time.monotonic() - start < 30, "the decode side did not notice"
            run.decoder.step()
            time.sleep(0.01)
        ((_, reason),) = run.decoder.take_failures()
        assert "connection lost" in reason, reason
        assert_pools_empty(run.decoder)
    finally:
        run.decoder.close()


@needs_nixl
def test_decode_gone_mid_read_frees_the_prefill_side_after_its_deadline(tiny_models):
    """The decode worker vanishes while reading: the prefill side keeps the pages it offered
    until the decode side's transfer timeout has passed (a page reused sooner could reach a
    late READ as another request's state), then gives them back and serves on."""
    model_dir, _ = tiny_models("base")
    run = pair(
        model_dir,
        "nixl",
        dict(page_size=4),
        dict(page_size=4),
        transfer_timeout_s=1.0,
        lease_timeout_s=0.5,
        bootstrap_timeout_s=0.5,
    )
    run.decoder.reader.faults = dataclasses.replace(NO_FAULTS, stall_reads=True)
    prompt = list(range(3, 30))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        run.decoder.add_request("r", prompt, params, room="r", prefill_addr=run.prefill.address)
        run.prefill.add_request("r", prompt, params, room="r")
        start = time.monotonic()
        while not run.decoder.reader.reads:
            assert time.monotonic() - start < 30, "the read never started"
            run.prefill.step()
            run.decoder.step()
        run.decoder.close()
        held_at = time.monotonic()
        while run.prefill.has_unfinished_requests():
            assert time.monotonic() - start < 30, "the prefill side kept the pages"
            run.prefill.step()
            time.sleep(0.01)
        assert time.monotonic() - held_at >= 0.5  # not before the decode side's deadline
        assert_pools_empty(run.prefill)
        assert run.prefill.counters.holds_expired == 1
    finally:
        run.prefill.close()


@needs_nixl
def test_backends_that_differ_are_refused_naming_both(tiny_models):
    model_dir, _ = tiny_models("base")
    ctx = zmq.Context()
    prefill = PrefillWorker(
        Engine(model_dir, page_size=4), config("prefill", transfer_backend="nixl"), ctx
    )
    decoder = DecodeWorker(
        Engine(model_dir, page_size=4), config("decode", transfer_backend="zmq"), ctx
    )
    run = Run(prefill, decoder)
    try:
        ((_, reason),) = serve_one(run, "r", list(range(3, 20)))
        assert "transfer_backend differs: prefill worker has 'nixl', decode worker has 'zmq'" in (
            reason
        ), reason
        assert "--disaggregation-transfer-backend" in reason
        settle(run, 0.2)
        assert_pools_empty(prefill, decoder)
    finally:
        close(run)


# -- the descriptors themselves (no NIXL needed) ---------------------------------------------


def test_read_plan_merges_page_runs_and_checks_every_index(tiny_models):
    """Descriptors follow the state spec: per paged tensor and layer one per run of pages
    consecutive on both sides, per slot tensor and layer one for the slot and one per
    checkpoint the decode side does not cache; an index past its region is refused."""
    model_dir, _ = tiny_models("base")
    engine = Engine(model_dir, page_size=4)
    layout = engine.handover.layout()
    pools = engine.handover.pool_tensors()
    local = {name: region_of(name, t) for name, t in pools.items()}
    remote = check_regions(layout, list(local.values()))
    here = StatePlace(pages=(3, 4, 5, 9), slot=2, checkpoint_slots=(0, 5))
    there = StatePlace(pages=(7, 8, 20, 21), slot=3, checkpoint_slots=(6, 7))
    plan = plan_read(layout, local, remote, there, here)
    paged = sum(t.layers for t in layout.of_kind("paged"))
    slots = layout.of_kind("slot")
    kept = sum(t.layers for t in slots if t.checkpointed)
    # runs: (3,7)x2, (5,20)x1, (9,21)x1; one checkpoint read (block 0 is cached here)
    assert len(plan.local) == 3 * paged + sum(t.layers for t in slots) + kept
    assert [n for _, n, _ in plan.local] == [n for _, n, _ in plan.remote]
    with pytest.raises(ValueError, match="page"):
        plan_read(layout, local, remote, dataclasses.replace(there, pages=(7, 8, 10**9, 1)), here)
    with pytest.raises(ValueError, match="slot 0"):
        plan_read(layout, local, remote, dataclasses.replace(there, slot=0), here)
    with pytest.raises(ValueError, match="offers pools"):
        check_regions(layout, list(local.values())[1:])
