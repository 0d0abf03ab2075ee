"""A family whose only state is a toy mixer's three tensors of its own (tests/toy_mixer.py: one
paged, one per slot split by heads, one per slot replicated; registered through the registry
only) runs every path the Mamba2 families run, with no edit to the pools, the prefix cache, the
handover, the wire protocol or the TP planning: they all follow its state spec.

    batched + chunked  == the toy's own reference (whole sequences, from its definition)
    prefix cache on    == off, with hits (its slot state resumed from checkpoints)
    PD pair            == colocated, TP 1 -> 1, 2 -> 1, 1 -> 2
    a handover that leaves one tensor out gives other tokens (the comparison can fail)
"""

from __future__ import annotations

import json

import pytest
import torch
import zmq
from safetensors.torch import save_file

import tests.toy_family as toy
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.rooms import DisaggConfig
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.handover.io import StateIO
from baton.kernels.cpu import ops as cpu_ops

SECRET = "toy-s3cret"
CONFIG = dict(
    architectures=[toy.ARCHITECTURE],
    model_type="toy",
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=2,
    num_heads=4,
    head_dim=8,
    peak_channels=4,
    decay=0.75,
    rms_norm_eps=1e-6,
    chunk_size=8,
    eos_token_id=0,
    torch_dtype="float32",
    max_position_embeddings=1024,
)
ARGS = dict(page_size=4, chunked_prefill_size=8, max_num_batched_tokens=16, mamba_track_interval=8)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 48, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    """(model directory, the same model in memory for the reference)."""
    path = tmp_path_factory.mktemp("toy")
    config = ModelConfig.from_dict(CONFIG)
    torch.manual_seed(0)
    model = toy.Model(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors"
    )
    return path, model.eval()


def greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        row = toy.reference_logits(model, ids)[-1].log_softmax(-1)
        ids.append(int(row.argmax()))
        logprobs.append(float(row.max()))
    return ids[len(prompt) :], logprobs


def run(engine: Engine, items: list[list[int]], params=PARAMS) -> dict[str, tuple]:
    """request id -> (tokens, chosen logprobs, cached tokens), every prompt at once."""
    out: dict[str, tuple] = {}
    for i, p in enumerate(items):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens, lps, _ = out.get(d.request_id, ([], [], 0))
            lps += [lp[t] for t, lp in zip(d.new_token_ids, d.new_logprobs or [])]
            out[d.request_id] = (tokens + d.new_token_ids, lps, d.num_cached_tokens)
    return out


def test_the_pools_are_the_toys_spec(toy_model):
    engine = Engine(toy_model[0], **ARGS)
    assert set(engine.cache.pools) == {"toy.mem", "toy.acc", "toy.peak"}
    assert engine.cache.pools["toy.mem"].shape[2:] == (4, 8)
    assert engine.cache.pools["toy.peak"].shape[2:] == (4,)


@pytest.mark.parametrize("attention", ["c", "torch"])
def test_batched_and_chunked_runs_match_the_reference(toy_model, attention, monkeypatch):
    """Also on the torch attention path (no C compiler, or BATON_CPU_OPS=0): the toy's paged
    state is not named attention.k, and its decode rows once got no mask there."""
    if attention == "torch":
        monkeypatch.setattr(cpu_ops, "decode_attention_supported", lambda q, k_cache: False)
    model_dir, model = toy_model
    items = prompts(1, (3, 13, 29, 8))
    got = run(Engine(model_dir, **ARGS), items)  # 16 tokens a step: chunked and batched
    for i, p in enumerate(items):
        tokens, logprobs = greedy_reference(model, p, PARAMS.max_tokens)
        assert got[f"r{i}"][0] == tokens, i
        torch.testing.assert_close(got[f"r{i}"][1], logprobs, atol=1e-4, rtol=0)


def test_prefix_cache_on_equals_off_with_hits(toy_model):
    model_dir, _ = toy_model
    first = prompts(2, (21, 34))
    second = [first[0][:16] + [5, 6, 7], first[1][:24] + [9] * 9]
    cached, plain = (
        Engine(model_dir, **ARGS),
        Engine(model_dir, **ARGS, enable_prefix_caching=False),
    )
    for items in (first, second):
        with_cache, without = run(cached, items), run(plain, items)
        for rid in without:
            assert with_cache[rid][0] == without[rid][0], rid
            torch.testing.assert_close(with_cache[rid][1], without[rid][1], atol=1e-4, rtol=0)
    hits = run(cached, second)  # the same prompts again: every block of them is cached
    assert [hits[f"r{i}"][2] for i in range(2)] == [16, 32]
    assert cached.stats().prefix_cache_hit_tokens > 0
    stats = cached.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def disagg_config(role: str) -> DisaggConfig:
    return DisaggConfig(
        role=role,
        host="127.0.0.1",
        port=0,
        secret=SECRET.encode(),
        bootstrap_timeout_s=20.0,
        transfer_timeout_s=20.0,
        heartbeat_interval_s=0.2,
        lease_timeout_s=30.0,
        max_rooms_per_peer=64,
        transfer_backend="zmq",
    )


@pytest.fixture(scope="module")
def workers(toy_model):
    """(role, tp size) -> its worker, built on first use, closed at the end."""
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_ENV, SECRET)
    context = zmq.Context()
    built: dict[tuple[str, int], PrefillWorker | DecodeWorker] = {}

    def get(role: str, size: int):
        if (role, size) not in built:
            engine = Engine(
                toy_model[0],
                tensor_parallel_size=size,
                handover_connector=connector_spec(role, "127.0.0.1"),
                **ARGS,
            )
            cls = PrefillWorker if role == "prefill" else DecodeWorker
            built[role, size] = cls(engine, disagg_config(role), context)
        return built[role, size]

    yield get
    for worker in built.values():
        worker.close()
        worker.engine.close()
    patch.undo()


def run_pair(prefill, decoder, items, tag: str) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for i, p in enumerate(items):
        room = f"{tag}-{i}"
        decoder.add_request(f"r{i}", p, PARAMS, room=room, prefill_addr=prefill.address)
        prefill.add_request(f"r{i}", p, PARAMS, room=room)
    for _ in range(100_000):
        if not (decoder.has_unfinished_requests() or prefill.has_unfinished_requests()):
            break
        prefill.step()
        for d in decoder.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert decoder.take_failures() == [] and prefill.take_failures() == []
    for worker in (prefill, decoder):
        stats = worker.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    return got


@pytest.mark.parametrize("sizes", [(1, 1), (2, 1), (1, 2)])
def test_pd_pair_equals_colocated(toy_model, workers, sizes):
    """Twice: the second round's prompts extend the first's, so both sides resume from their
    prefix caches (blocks checkpointed on either side)."""
    items = prompts(3, (5, 19, 30))
    expect = {k: v[0] for k, v in run(Engine(toy_model[0], **ARGS), items).items()}
    prefill, decoder = workers("prefill", sizes[0]), workers("decode", sizes[1])
    assert run_pair(prefill, decoder, items, f"a{sizes}") == expect
    again = [p + [7, 8, 9] for p in items]
    expect = {k: v[0] for k, v in run(Engine(toy_model[0], **ARGS), again).items()}
    assert run_pair(prefill, decoder, again, f"b{sizes}") == expect


def test_a_handover_that_leaves_a_tensor_out_is_caught(toy_model, workers, monkeypatch):
    """The same comparison with the replicated `peak` state zeroed on its way out (as if the
    handover did not carry it): the decode side computes other tokens."""
    items = prompts(4, (12, 27))
    expect = {k: v[0] for k, v in run(Engine(toy_model[0], **ARGS), items).items()}
    copy, views = StateIO.copy_slot_state, StateIO.unit_views

    def snapshot_without_peak(io, slot):  # the final state copied for a StateTransfer
        state = copy(io, slot)
        state["toy.peak"].zero_()
        return state

    def pushed_without_peak(io, slot, unit):  # the final state pushed ahead (SlotChunks)
        return [
            (frame, torch.zeros_like(t) if frame.startswith("toy.peak") else t)
            for frame, t in views(io, slot, unit)
        ]

    monkeypatch.setattr(StateIO, "copy_slot_state", snapshot_without_peak)
    monkeypatch.setattr(StateIO, "unit_views", pushed_without_peak)
    prefill, decoder = workers("prefill", 1), workers("decode", 1)
    assert run_pair(prefill, decoder, items, "dropped") != expect
