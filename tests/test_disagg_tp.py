"""Disaggregation across tensor-parallel sizes (CPU, gloo, fp32): prefill TP=2 -> decode TP=1
and prefill TP=1 -> decode TP=2 give the greedy tokens of a colocated TP=1 engine; each decode
rank receives exactly the K/V heads, conv channels and SSM heads it owns, straight from the
prefill rank that holds them; the handshake refuses a layout pair it cannot serve, naming both;
a lying peer fails its room, never the engine. The prompt's prefix-cache block checkpoints
travel the same way (sliced like the final conv / SSM state), so the decode side caches the
transferred prompt as a TP=1 handover does. With the nixl backend (1:2, 2:1, 2:2, 4:2) each decode
rank READs exactly those units from the prefill ranks' pools instead, with the same tokens; a
peer gone mid-read fails only its room, with every page and slot back on both sides.

The model has n_groups = 1 (B and C replicated on every rank: one prefill rank sends them) and
one KV head for two ranks (replicated too). One engine per role and size serves every case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch
import zmq

from baton.disagg.decode import DecodeWorker
from baton.disagg.messages import (
    PoolRegion,
    Register,
    ShardOffer,
    ShardTransfer,
)
from baton.disagg.prefill import PrefillWorker
from baton.disagg.protocol import (
    decode,
    encode,
    state_message,
    tensor_specs,
)
from baton.disagg.rooms import DisaggConfig, FaultInjection
from baton.disagg.tp_layout import TPLayout, owned, plan
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.handover.state import RequestState
from baton.engine.models.registry import model_state_spec
from baton.engine.parallel.messages import InstallShard
from tests.nixl_required import needs_nixl
from tests.tiny import save_tiny_model

SECRET = "tp-s3cret"
SHAPE = dict(
    n_groups=1,
    num_key_value_heads=1,
    vocab_size=301,
    hybrid_override_pattern="M*-M-M*",
)
# Prefix-cache blocks of 16 tokens (the SSD chunk size): prompts of 16+ tokens have checkpoints.
INTERVAL = 16
ENGINE_ARGS = dict(
    page_size=4, chunked_prefill_size=16, max_num_batched_tokens=32, mamba_track_interval=INTERVAL
)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = _prompts(0, (5, 40, 63, 17))


def _config(role: str, backend: str = "zmq") -> DisaggConfig:
    return DisaggConfig(
        role=role,
        host="127.0.0.1",
        port=0,
        secret=SECRET.encode(),
        bootstrap_timeout_s=10.0,
        transfer_timeout_s=10.0,
        heartbeat_interval_s=0.2,
        lease_timeout_s=20.0,
        max_rooms_per_peer=64,
        transfer_backend=backend,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg-tp")
    save_tiny_model(path, seed=3, tokenizer=False, **SHAPE)
    return path


@pytest.fixture(scope="module")
def colocated(model_dir) -> Engine:
    """The reference: a colocated TP=1 engine (its prefix cache holds the TP=1 checkpoints)."""
    return Engine(model_dir, **ENGINE_ARGS)


def colocated_tokens(engine: Engine, prompts, tag: str = "r") -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, PARAMS)
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return out


@pytest.fixture(scope="module")
def expected(colocated) -> dict[str, list[int]]:
    return colocated_tokens(colocated, PROMPTS)


class TPWorkers:
    """(role, tp size[, track interval][, transfer backend][, instance][, DisaggConfig changes])
    -> its worker on `model_dir`, built on first use with its ranks' connectors; `gone` closes
    one (its process gone, as far as its peers can tell)."""

    def __init__(self, model_dir, engine_args: dict) -> None:
        self.model_dir, self.engine_args = model_dir, engine_args
        self.context = zmq.Context()
        self.built: dict[tuple, PrefillWorker | DecodeWorker] = {}

    def __call__(
        self,
        role: str,
        size: int,
        interval: int = INTERVAL,
        backend: str = "zmq",
        instance: str = "",
        **changes,
    ):
        """`instance`: another worker of the same kind (one a test may see go)."""
        key = (role, size, interval, backend, instance, tuple(sorted(changes.items())))
        if key not in self.built:
            engine = Engine(
                self.model_dir,
                tensor_parallel_size=size,
                handover_connector=connector_spec(role, "127.0.0.1", backend),
                **self.engine_args | {"mamba_track_interval": interval},
            )
            cls = PrefillWorker if role == "prefill" else DecodeWorker
            config = dataclasses.replace(_config(role, backend), **changes)
            self.built[key] = cls(engine, config, self.context)
        return self.built[key]

    def gone(self, worker) -> None:
        for key, built in list(self.built.items()):
            if built is worker:
                del self.built[key]
        worker.close()
        worker.engine.close()

    def close(self) -> None:
        for worker in list(self.built.values()):
            self.gone(worker)


@contextlib.contextmanager
def tp_workers(model_dir, engine_args: dict):
    """TPWorkers on `model_dir`, every rank with the shared secret and UCX over TCP on loopback
    (nixl), closed at the end."""
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_ENV, SECRET)  # every rank's connector (the ranks inherit it)
    patch.setenv("UCX_TLS", "tcp,self")  # nixl: UCX over TCP on loopback, in every rank
    workers = TPWorkers(model_dir, engine_args)
    try:
        yield workers
    finally:
        workers.close()
        patch.undo()


@pytest.fixture(scope="module")
def workers(model_dir):
    with tp_workers(model_dir, ENGINE_ARGS) as get:
        yield get


def run_pair(
    prefill, decoder, prompts, tag: str, timeout: float = 60.0, cached: dict | None = None
) -> dict[str, list[int]]:
    """Each prompt's greedy tokens through the pair (`cached`: request id -> prompt tokens the
    decode side had cached)."""
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        room = f"{tag}-room{i}"
        decoder.add_request(f"r{i}", prompt, PARAMS, room=room, prefill_addr=prefill.address)
        prefill.add_request(f"r{i}", prompt, PARAMS, room=room)
    start = time.time()
    while decoder.has_unfinished_requests() or prefill.has_unfinished_requests():
        assert time.time() - start < timeout, "the pair did not finish"
        prefill.step()
        for delta in decoder.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if cached is not None:
                cached.setdefault(delta.request_id, delta.num_cached_tokens)
    return got


def settle(prefill, decoder, seconds: float = 0.3) -> None:
    """Step both sides a moment (ReadDone and Abort reach the prefill side between steps)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        prefill.step()
        decoder.step()


def assert_clean(*workers) -> None:
    for worker in workers:
        assert worker.take_failures() == []
        stats = worker.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def spec_of(config: ModelConfig) -> ModelStateSpec:
    return model_state_spec(config, torch.float32)


def owned_bytes(
    config: ModelConfig, size: int, rank: int, *, pages: int, states: int, blocks: int
) -> int:
    """What decode rank `rank` of `size` holds of `pages` pages, `states` final slot states and
    `blocks` block checkpoints, counted from the state spec by hand (units x unit bytes)."""
    spec, total = spec_of(config), 0
    for component, ranges in owned(spec, size, rank).items():
        field, name = component.split("/", 1)
        group, tensor = spec.tensor(name)
        unit_bytes = tensor.bytes() // tensor.shape[tensor.unit_dim]
        count = {"pages": pages * ENGINE_ARGS["page_size"], "slots": states, "checkpoints": blocks}
        units = sum(n for _, n in ranges)
        total += units * unit_bytes * group.num_layers * count[field]
    return total


def pages_of(prompts) -> int:
    return sum(-(-len(p) // ENGINE_ARGS["page_size"]) for p in prompts)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (2, 4)])
def test_each_decode_rank_is_planned_exactly_its_units_from_ranks_that_hold_them(
    model_dir, sizes, split
):
    """Every unit a decode rank owns comes from exactly one prefill rank holding that same unit
    at the offset given, and nothing else comes. split: 4 KV heads and 4 groups, split rather
    than replicated."""
    config = ModelConfig.from_hf(model_dir)
    if split:
        hybrid = config.family
        config = dataclasses.replace(
            config,
            family=dataclasses.replace(
                hybrid,
                attention=dataclasses.replace(hybrid.attention, num_kv_heads=4),
                mamba=dataclasses.replace(hybrid.mamba, n_groups=4),
            ),
        )
    spec = spec_of(config)
    prefill_size, decode_size = sizes
    for rank in range(decode_size):
        got: dict[str, list[int]] = {}
        for p in plan(spec, prefill_size, decode_size, rank):
            held = owned(spec, prefill_size, p.source)[p.component]
            src_units = [u for s, n in held for u in range(s, s + n)]
            dst_units = [
                u for s, n in owned(spec, decode_size, rank)[p.component] for u in range(s, s + n)
            ]
            assert (
                src_units[p.src_offset : p.src_offset + p.length]
                == dst_units[p.dst_offset : p.dst_offset + p.length]
            )
            got.setdefault(p.component, []).extend(
                dst_units[p.dst_offset : p.dst_offset + p.length]
            )
        for component, ranges in owned(spec, decode_size, rank).items():
            assert sorted(got[component]) == [u for s, n in ranges for u in range(s, s + n)]


# nixl: every decode rank READs its slices from each prefill rank's pools (disagg/nixl_shards.py)
PAIRS = [
    ("zmq", (2, 1)),
    ("zmq", (1, 2)),
    pytest.param("nixl", (2, 1), marks=needs_nixl),
    pytest.param("nixl", (1, 2), marks=needs_nixl),
    pytest.param("nixl", (2, 2), marks=needs_nixl),
    pytest.param("nixl", (4, 2), marks=needs_nixl),
]


@pytest.mark.parametrize(("backend", "sizes"), PAIRS)
def test_pd_across_tp_sizes_matches_colocated_tp1(workers, expected, model_dir, backend, sizes):
    """The tokens of a colocated TP=1 engine (so the zmq and nixl pairs' tokens are the same),
    each decode rank getting exactly its units: as frames (zmq) or READ in place (nixl: the
    prefill side offered what the decode ranks read, not a byte more, and nothing came as
    frames)."""
    prefill_size, decode_size = sizes
    prefill = workers("prefill", prefill_size, backend=backend)
    decoder = workers("decode", decode_size, backend=backend)
    decoder.engine.reset_prefix_cache()  # (a worker another case used: every block travels)
    before = list(decoder.engine.handover.shards.bytes_received)
    counted = (decoder.counters.bytes_total, prefill.counters.bytes_total)
    hits_before = decoder.stats().prefix_cache_hit_tokens
    got = run_pair(prefill, decoder, PROMPTS, tag=f"{backend}-p{prefill_size}d{decode_size}")
    assert got == expected
    if backend == "nixl":
        settle(prefill, decoder)  # the ReadDones reach the prefill side
    assert_clean(prefill, decoder)
    assert decoder.counters.transfers_ok >= len(PROMPTS)
    # Every decode rank received exactly the bytes of the heads and channels it owns: pages,
    # final states, and the checkpoints of every prompt block it did not cache already.
    config = ModelConfig.from_hf(model_dir)
    received = [
        a - b for a, b in zip(decoder.engine.handover.shards.bytes_received, before, strict=True)
    ]
    hit_blocks = (decoder.stats().prefix_cache_hit_tokens - hits_before) // INTERVAL
    blocks = sum(len(p) // INTERVAL for p in PROMPTS) - hit_blocks
    assert blocks > 0
    assert received == [
        owned_bytes(
            config, decode_size, rank, pages=pages_of(PROMPTS), states=len(PROMPTS), blocks=blocks
        )
        for rank in range(decode_size)
    ]
    read = decoder.counters.bytes_total - counted[0]
    assert read == sum(received)
    if backend == "nixl":
        assert prefill.counters.bytes_total - counted[1] == read  # offered = read
        assert prefill.counters.kv_chunks == 0
        stats = decoder.extra_stats()
        assert stats["disagg_backend_transfers_total:nixl"] >= len(PROMPTS)


def assert_checkpoints_as_colocated(decoder, colocated: Engine, prompt, num_blocks: int) -> None:
    """The decode side caches the prompt's first `num_blocks` blocks, and each checkpoint holds,
    on every rank, that rank's slice of the colocated TP=1 engine's checkpoint at the same block
    end: rank 0 compared tensor by tensor, the others by the per-slot sums they report."""
    engine = decoder.engine
    keys = colocated.prefix_cache.chain_keys(prompt, num_blocks, adapter=None)
    blocks = [engine.prefix_cache.lookup(key) for key in keys]
    assert None not in blocks, "the decode side does not cache the transferred blocks"
    reference = [colocated.prefix_cache.lookup(key).checkpoint_slot for key in keys]
    digests = engine.ranks.pool_digests(engine.cache) if engine.ranks is not None else None
    # where each pool's rows start in a rank's digest (engine/parallel/messages.py pool_digest)
    offsets, row = {}, 0
    for name, pool in engine.cache.pools.items():
        offsets[name], row = row, row + pool.shape[1]
    tp_size = engine.handover.shards.tp_size
    for rank in range(tp_size):
        units = owned(engine.state_spec, tp_size, rank)
        for block, ref_slot in zip(blocks, reference, strict=True):
            slot = block.checkpoint_slot
            for name in engine.cache.slotted:
                ranges = units[f"checkpoints/{name}"]
                index = torch.cat([torch.arange(s, s + n) for s, n in ranges])
                want = colocated.cache.pools[name][:, ref_slot].index_select(1, index)
                assert want.abs().sum() > 0  # a real state, not a blank
                if rank == 0:
                    got = engine.cache.pools[name][:, slot]
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
                else:
                    got = digests[rank][offsets[name] + slot]
                    torch.testing.assert_close(got, want.double().sum(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(("backend", "sizes"), PAIRS[:4])
def test_next_turn_hits_the_decode_side_cache_of_a_tp_handover(
    workers, colocated, model_dir, backend, sizes
):
    """After a handover across TP sizes the decode worker caches the prompt's blocks with the
    prefill side's checkpoints (each rank its slice), so the next request sharing the prompt's
    first blocks hits its cache there; only the blocks it lacks travel (or are read), and the
    tokens equal a colocated TP=1 engine's."""
    prefill_size, decode_size = sizes
    prefill = workers("prefill", prefill_size, backend=backend)
    decoder = workers("decode", decode_size, backend=backend)
    tag = f"turns-{backend}-p{prefill_size}d{decode_size}"
    first = _prompts(10 + decode_size, (40,))[0]  # blocks 0, 1 (and 8 tokens)
    second = first[: 2 * INTERVAL] + _prompts(20 + decode_size, (36,))[0]  # + blocks 2, 3
    expect = colocated_tokens(colocated, [first, second], tag=tag)
    cached: dict[str, int] = {}
    blocks_before = decoder.stats().prefix_cache_blocks
    assert run_pair(prefill, decoder, [first], tag=tag, cached=cached) == {"r0": expect[f"{tag}0"]}
    assert cached == {"r0": 0}
    assert decoder.stats().prefix_cache_blocks == blocks_before + 2  # (the stats show them)
    assert_checkpoints_as_colocated(decoder, colocated, first, 2)
    before = list(decoder.engine.handover.shards.bytes_received)
    cached = {}
    got = run_pair(prefill, decoder, [second], tag=tag + "b", cached=cached)
    assert got == {"r0": expect[f"{tag}1"]}
    assert cached["r0"] == 2 * INTERVAL  # the decode side resumed from a transferred checkpoint
    assert_checkpoints_as_colocated(decoder, colocated, second, 4)
    settle(prefill, decoder)
    # Only what the decode side lacked travelled: pages 8.. and the checkpoints of blocks 2, 3.
    config = ModelConfig.from_hf(model_dir)
    received = [
        a - b for a, b in zip(decoder.engine.handover.shards.bytes_received, before, strict=True)
    ]
    pages = pages_of([second]) - 2 * INTERVAL // ENGINE_ARGS["page_size"]
    assert received == [
        owned_bytes(config, decode_size, rank, pages=pages, states=1, blocks=2)
        for rank in range(decode_size)
    ]
    assert_clean(prefill, decoder)
    assert not decoder.engine.handover.shards.checkpoint_slots


def test_no_checkpoints_travel_between_sides_cutting_blocks_differently(
    workers, colocated, model_dir
):
    """A decode worker whose blocks are 32 tokens cannot use 16-token checkpoints: none are
    sent, none are registered, and the tokens still equal a colocated engine's."""
    prefill, decoder = workers("prefill", 2), workers("decode", 1, interval=2 * INTERVAL)
    prompt = _prompts(30, (40,))[0]
    expect = colocated_tokens(colocated, [prompt], tag="intervals")
    before = list(decoder.engine.handover.shards.bytes_received)
    assert run_pair(prefill, decoder, [prompt], tag="intervals") == {"r0": expect["intervals0"]}
    received = decoder.engine.handover.shards.bytes_received[0] - before[0]
    config = ModelConfig.from_hf(model_dir)
    assert received == owned_bytes(config, 1, 0, pages=pages_of([prompt]), states=1, blocks=0)
    assert decoder.stats().prefix_cache_blocks == 0
    assert_clean(prefill, decoder)


NO_STALL = FaultInjection(drop_probability=0.0, delay_ms=0, stall_reads=False)
STALL = dataclasses.replace(NO_STALL, stall_reads=True)  # READs are never seen to end


def start_until_read(prefill, decoder, connector, prompt, room: str) -> None:
    """One room through the pair until `connector` (a decode rank's) has posted its READs."""
    decoder.add_request(room, prompt, PARAMS, room=room, prefill_addr=prefill.address)
    prefill.add_request(room, prompt, PARAMS, room=room)
    start = time.monotonic()
    while not connector.reads:
        assert time.monotonic() - start < 30, "the read never started"
        prefill.step()
        decoder.step()


@needs_nixl
def test_nixl_prefill_gone_mid_read_fails_the_room_and_frees_the_tp2_decode_side(workers, expected):
    """A prefill worker goes while decode rank 0 of a TP=2 pair reads from it (fault injection:
    rank 0 never sees its READ end): the dropped connection fails the room (its client gets a
    503), every rank's READ is stopped before the pages may go, the pages, slot and checkpoint
    slots come back, and the next rooms give the colocated tokens."""
    decoder = workers("decode", 2, backend="nixl")
    decoder.engine.reset_prefix_cache()
    connector = decoder.engine.handover.shards.connector
    doomed = workers("prefill", 1, backend="nixl", instance="gone")
    connector.faults = STALL
    try:
        start_until_read(doomed, decoder, connector, PROMPTS[1], "gone-mid-read")
        assert decoder.stats().kv_pages_used > 0 and decoder.rooms["gone-mid-read"].sharded
        workers.gone(doomed)
        start = time.monotonic()
        while decoder.has_unfinished_requests():
            assert time.monotonic() - start < 30, "the decode side did not notice"
            decoder.step()
            time.sleep(0.01)
    finally:
        connector.faults = NO_STALL
    ((rid, reason),) = decoder.take_failures()
    assert rid == "gone-mid-read" and "connection lost" in reason, reason
    assert not connector.reads  # stopped (DropShard), not left to write into freed pages
    assert_clean(decoder)
    assert not decoder.engine.handover.shards.checkpoint_slots
    prefill = workers("prefill", 1, backend="nixl")
    assert run_pair(prefill, decoder, PROMPTS[:2], tag="after-gone") == {
        k: expected[k] for k in ("r0", "r1")
    }
    settle(prefill, decoder)
    assert_clean(prefill, decoder)


@needs_nixl
def test_nixl_decode_gone_mid_read_frees_the_tp2_prefill_side_after_its_deadline(workers, expected):
    """A decode worker goes while it reads from a TP=2 prefill worker: the prefill side keeps
    the pages and slot it offered (on every rank: they mirror rank 0's) until the decode side's
    transfer timeout has passed, then gives them back and serves the next pair as colocated."""
    prefill = workers("prefill", 2, backend="nixl")
    doomed = workers(
        "decode",
        1,
        backend="nixl",
        instance="gone",
        transfer_timeout_s=1.0,
        lease_timeout_s=0.5,
        bootstrap_timeout_s=0.5,
    )
    connector = doomed.engine.handover.shards.connector
    connector.faults = STALL
    expired = prefill.counters.holds_expired
    start_until_read(prefill, doomed, connector, PROMPTS[1], "reader-gone")
    assert prefill.stats().kv_pages_used > 0
    workers.gone(doomed)
    held_at = time.monotonic()
    while prefill.has_unfinished_requests():
        assert time.monotonic() - held_at < 30, "the prefill side kept the pages"
        prefill.step()
        time.sleep(0.01)
    assert time.monotonic() - held_at >= 0.5  # not before the decode side's deadline
    assert prefill.counters.holds_expired == expired + 1
    prefill.take_failures()
    assert_clean(prefill)
    decoder = workers("decode", 1, backend="nixl")
    assert run_pair(prefill, decoder, PROMPTS[:2], tag="after-reader-gone") == {
        k: expected[k] for k in ("r0", "r1")
    }
    settle(prefill, decoder)
    assert_clean(prefill, decoder)


def _offer(config: ModelConfig, room: str, rank: int, pages: int, blocks: int) -> ShardOffer:
    """What prefill rank `rank` of 2 would offer a decode rank for a room of `pages` pages and
    `blocks` block checkpoints: its own pools' regions (rows of its slices), valid indices."""
    spec = spec_of(config)
    pools = [
        PoolRegion(
            name=name,
            address=(1 << 40) + (i << 32) + (rank << 36),
            layers=group.num_layers,
            rows=256,
            row_bytes=tensor.bytes(2, rank),
            memory="DRAM",
            device=0,
        )
        for i, (name, group, tensor) in enumerate(spec.entries())
    ]
    return ShardOffer(
        room=room,
        source_rank=rank,
        source_size=2,
        first_page=0,
        first_block=0,
        agent=f"prefill-rank{rank}",
        agent_metadata=b"never loaded: every check comes first",
        pools=pools,
        pages=list(range(10, 10 + pages)),
        slot=3,
        checkpoint_slots=list(range(20, 20 + blocks)),
    )


def _rows_doubled(offer: ShardOffer) -> ShardOffer:
    pools = [dataclasses.replace(offer.pools[0], row_bytes=offer.pools[0].row_bytes * 2)]
    return dataclasses.replace(offer, pools=pools + offer.pools[1:])


# case -> (what prefill rank 1's offer says instead, what the refusal names)
FORGED_OFFERS = {
    "page past its pool": (lambda o: dataclasses.replace(o, pages=[1 << 30, *o.pages[1:]]), "page"),
    "the dummy slot": (lambda o: dataclasses.replace(o, slot=0), "slot 0"),
    "one page short": (lambda o: dataclasses.replace(o, pages=o.pages[1:]), "pages, this request"),
    "a checkpoint short": (
        lambda o: dataclasses.replace(o, checkpoint_slots=o.checkpoint_slots[1:]),
        "block checkpoints",
    ),
    "rows of another size": (_rows_doubled, "rows"),
    "another TP size": (lambda o: dataclasses.replace(o, source_size=4), "offers TP=4"),
    "pools missing": (lambda o: dataclasses.replace(o, pools=o.pools[1:]), "offers pools"),
}


@needs_nixl
def test_forged_shard_offers_are_refused_before_any_read(workers, model_dir):
    """A decode rank takes prefill ranks' ShardOffers on its authenticated port and checks each
    against its plan before loading any metadata or posting a READ: an index outside its
    region, the dummy slot, counts that are not the room's, rows that are not the prefill rank's
    slices, another TP size, missing pools: refused naming the problem, nothing read."""
    decoder = workers("decode", 1, backend="nixl")
    connector = decoder.engine.handover.shards.connector
    config = ModelConfig.from_hf(model_dir)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(connector.address)
    op = dict(pages=(1, 2, 3), slot=1, first_page=0, prefill_size=2, first_block=0)
    loaded = list(connector.loaded)  # prefill agents it reads from (none of these)
    try:
        for case, (change, named) in FORGED_OFFERS.items():
            room = f"forged {case}"
            for rank in (0, 1):
                offer = _offer(config, room, rank, pages=3, blocks=2)
                if rank == 1:
                    offer = change(offer)
                push.send_multipart(encode(offer, [], SECRET.encode()))
            install = InstallShard(room=room, num_blocks=2, checkpoint_slots=(4, 0), **op)
            deadline = time.time() + 10
            while (pieces := _refusal(connector, install)) is None:
                assert time.time() < deadline, f"{case}: the offers never arrived"
                time.sleep(0.01)
            assert named in pieces, (case, pieces)
            assert not connector.reads and list(connector.loaded) == loaded, case
    finally:
        push.close(linger=0)


def _refusal(connector, install: InstallShard) -> str | None:
    """Why the connector refuses the op's offers (None while they have not all arrived)."""
    try:
        result = connector.receive(install)
    except ValueError as error:
        return str(error)
    assert result is None, "a forged offer was read"
    return None


def _register(room: str, compat, tp: TPLayout) -> Register:
    return Register(
        room=room,
        compat=compat,
        num_prompt_tokens=9,
        cached_tokens=0,
        track_interval=0,
        transfer_timeout_s=30.0,
        tp=tp,
    )


def _answers(dealer: zmq.Socket, prefill, count: int) -> list:
    out, deadline = [], time.time() + 10
    while len(out) < count and time.time() < deadline:
        prefill.poll()
        if dealer.poll(50):
            out.append(decode(dealer.recv_multipart(), SECRET.encode())[0])
    return out


def test_handshake_refuses_layouts_it_cannot_serve_naming_both(workers, expected):
    prefill = workers("prefill", 2)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(prefill.address)
    addr = "tcp://127.0.0.1:9"
    claims = {
        "three": TPLayout(size=3, rank_addresses=[addr] * 3),  # 1 KV head, 4 Mamba heads
        "zero": TPLayout(size=0, rank_addresses=[]),
        "short": TPLayout(size=2, rank_addresses=[addr]),
        "nowhere": TPLayout(size=2, rank_addresses=[addr, "ipc:///tmp/x"]),
        "huge": TPLayout(size=1 << 40, rank_addresses=[]),
    }
    for room, tp in claims.items():
        message = _register(room, prefill.compat, tp)
        dealer.send_multipart(encode(message, secret=SECRET.encode()))
    rejects = {m.room: m.message for m in _answers(dealer, prefill, len(claims))}
    dealer.close(linger=0)
    assert set(rejects) == set(claims)
    assert "prefill worker TP=2, decode worker TP=3" in rejects["three"]
    assert "divisible" in rejects["three"] or "must divide" in rejects["three"]
    assert "decode worker TP=0" in rejects["zero"]
    assert "1 rank addresses for 2 ranks" in rejects["short"]
    assert "decode rank 1" in rejects["nowhere"]
    assert not prefill.rooms
    # ... and the worker still serves a real pair.
    assert run_pair(prefill, workers("decode", 1), PROMPTS[:2], tag="after-rejects") == {
        k: expected[k] for k in ("r0", "r1")
    }


# case -> (claimed prefill TP size, extra K/V pages, decode ranks sent to, the control's first
# page, its checkpoint blocks, the blocks the pieces carry, what the failure says)
LIES = {
    "shape": (1, 1, 2, 0, 0, 0, "expected float32 [2, 10, 4, 1, 16]"),
    "size": (3, 0, 2, 0, 0, 0, "prefill worker claims TP=3"),
    "missing": (1, 0, 1, 0, 0, 0, "not every rank's shard from the prefill worker within 10 s"),
    "blocks": (1, 0, 2, 0, 5, 5, "checkpoints of blocks 0..4; this prompt has 2 blocks"),
    "checkpoint": (1, 0, 2, 0, 2, 1, "is float32 [1, 3, "),
    # over the decode side's cached prefix (its first 8 pages), which other requests share
    "cached": (1, 0, 2, 0, 0, 0, "sends pages from 0, expected from 8"),
}


def test_a_lying_prefill_peer_fails_its_room_and_the_decode_engine_serves_on(workers, expected):
    """A fake prefill worker answers a TP=2 decode worker's Register with shards that do not fit
    (a wrong shape; a claimed TP size the model cannot have; none for rank 1; more checkpoint
    blocks than the prompt has; checkpoints of fewer blocks than claimed; pages over the decode
    side's cached prefix): the room fails with a message naming the problem, the pools and
    checkpoint slots are freed, the cached prefix is intact, and the next real room is served."""
    decoder = workers("decode", 2)
    config = decoder.engine.model_config
    cached = PROMPTS[1]  # 40 tokens: its blocks 0, 1 (pages 0..7) cached on the decode side
    run_pair(workers("prefill", 1), decoder, [cached], tag="before-lies")
    fresh = _prompts(40, (40,))[0]
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fake = f"tcp://127.0.0.1:{port}"
    try:
        for case, lie in LIES.items():
            source_size, stretch, ranks, first_page, blocks, sent_blocks, text = lie
            prompt = cached if case == "cached" else fresh
            decoder.add_request(
                f"lie-{case}", prompt, PARAMS, room=f"lie-{case}", prefill_addr=fake
            )
            register = None
            deadline = time.time() + 10
            while not isinstance(register, Register):  # (heartbeats come too)
                decoder.step()
                assert time.time() < deadline
                if router.poll(50):
                    identity, *frames = router.recv_multipart()
                    register, _ = decode(frames, SECRET.encode())
            assert register.tp.size == 2 and len(register.tp.rank_addresses) == 2
            # Each decode rank gets the pieces a TP=1 prefill would send it, but as the case
            # says (the K/V pages one page longer than the prompt has, for "shape").
            pushes = []
            for rank, address in enumerate(register.tp.rank_addresses[:ranks]):
                push = zmq.Context.instance().socket(zmq.PUSH)
                push.connect(address)
                pushes.append(push)
                named = []
                for p in plan(spec_of(config), 1, 2, rank):
                    shape = {
                        "pages/attention.k": (2, -(-len(prompt) // 4) + stretch, 4, p.length, 16),
                        "pages/attention.v": (2, -(-len(prompt) // 4) + stretch, 4, p.length, 16),
                        "slots/mamba2.conv": (3, p.length, 3),
                        "slots/mamba2.ssm": (3, p.length, 16, 8),
                        "checkpoints/mamba2.conv": (sent_blocks, 3, p.length, 3),
                        "checkpoints/mamba2.ssm": (sent_blocks, 3, p.length, 16, 8),
                    }[p.component]
                    named.append((p.name, torch.zeros(shape)))
                shard = ShardTransfer(
                    room=register.room,
                    source_rank=0,
                    source_size=source_size,
                    first_page=first_page,
                    first_block=0,
                    tensors=tensor_specs(named),
                )
                push.send_multipart(encode(shard, [t for _, t in named], SECRET.encode()))
            control = _fake_state(config, prompt, first_page, blocks)
            message, tensors = state_message(register.room, control, tp_size=source_size)
            router.send_multipart([identity, *encode(message, tensors, SECRET.encode())])
            deadline = time.time() + 30
            failures = []
            while not failures and time.time() < deadline:
                decoder.step()
                failures = decoder.take_failures()
            for push in pushes:
                push.close(linger=0)
            assert failures and failures[0][0] == f"lie-{case}", failures
            assert text in failures[0][1], failures[0][1]
            stats = decoder.stats()
            assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0, case
            assert not decoder.engine.handover.shards.checkpoint_slots
    finally:
        router.close(linger=0)
    cached_tokens: dict[str, int] = {}
    got = run_pair(
        workers("prefill", 1), decoder, PROMPTS[:2], tag="after-lies", cached=cached_tokens
    )
    assert got == {k: expected[k] for k in ("r0", "r1")}
    assert cached_tokens["r1"] == 2 * INTERVAL  # from the cached prefix the lies did not touch


def _fake_state(config: ModelConfig, prompt, first_page: int, blocks: int):
    """A first-token state (what goes through rank 0) claiming pages from `first_page` and
    checkpoints of `blocks` blocks from block 0 (no pages, no slot layers: those go rank to
    rank)."""
    spec = spec_of(config)
    return RequestState(
        num_prompt_tokens=len(prompt),
        first_token=5,
        first_logprobs=None,
        first_page=first_page,
        first_block=0,
        pages={name: torch.empty(2, 0) for name in spec.names("paged")},
        slots={name: torch.empty(0, *spec.tensor(name)[1].shape) for name in spec.names("slot")},
        checkpoints={
            name: torch.empty(blocks, 0, *spec.tensor(name)[1].shape)
            for name in spec.checkpointed()
        },
    )


def test_install_report_carries_a_failed_ranks_reason_to_rank_0():
    """Rank 0 learns why another rank failed (cut to fit, on a character boundary or marked),
    so the room's error names the problem whichever rank's shard arrived first."""
    from types import SimpleNamespace

    from baton.engine.handover.shards import (
        FAILED,
        INSTALLED,
        REASON_BYTES,
        WAITING,
        WAITING_TEXT,
        install_report,
    )

    class Own:  # one rank's gather: its own row
        def gather_last_dim(self, x):
            self.row = x
            return x

    long_reason = "decode rank 1: checkpoint_conv@0 is float32 [1, 3, 48, 3] — über " * 20
    rank1, rank2 = Own(), Own()
    install_report(rank1, long_reason, None)
    install_report(rank2, "", SimpleNamespace(bytes_received=7))

    class Rank0:
        def gather_last_dim(self, x):
            return torch.cat([x, rank1.row, rank2.row], dim=-1)

    report = install_report(Rank0(), WAITING_TEXT, SimpleNamespace(bytes_received=123))
    assert report.statuses == [WAITING, FAILED, INSTALLED]
    assert report.received == [123, 0, 7]
    assert report.reasons[0] == report.reasons[2] == ""
    reason = report.reasons[1]
    assert len(reason.encode()) <= REASON_BYTES + 3  # a cut character becomes one U+FFFD
    assert long_reason.startswith(reason.rstrip("\ufffd")) and len(reason) > 100
    assert report.failure() == reason

    class AllWell:
        def gather_last_dim(self, x):
            return torch.cat([x, rank2.row], dim=-1)

    fine = install_report(AllWell(), "", None)
    assert fine.statuses == [INSTALLED, INSTALLED] and fine.failure() == ""
