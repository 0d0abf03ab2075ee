"""The gated DeltaNet families on the serving paths that follow the state spec (nothing in the
pools, prefix cache, handover, wire or TP planning names them):

    prefix cache on   == off, with hits resumed from GDN checkpoints (decode steps through the
                         padded runner: padding rows on the dummy slot, decode checkpoints)
    PD pair           == colocated, TP 1 -> 1, 2 -> 1, 1 -> 2, twice: the second round's
                         prompts extend the first's, so both workers resume from their caches
    colocated TP = 2  == TP = 1 (OLMo-Hybrid's whole-projection q/k norm spanning the ranks;
                         a key head replicated on both ranks: tests/test_gdn_layer.py)
    TP the heads cannot split: refused by key, for a PD worker as for colocated serving

Qwen3-Next runs the PD pairs: its packed projections are the ones whose TP slices are the most
intricate. Greedy, fp32; tokens and their logprobs compared (1e-4).
"""

from __future__ import annotations

import pytest
import torch
import zmq

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.rooms import DisaggConfig
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.engine.config_error import ConfigError
from baton.engine.core.engine import Engine
from tests.same_outputs import assert_same_outputs, assert_same_tokens_and_logprobs

SECRET = "gdn-s3cret"
# GDN checkpoints sit on multiples of its chunk (64) and of the page size.
ARGS = dict(
    page_size=4, chunked_prefill_size=32, max_num_batched_tokens=64, mamba_track_interval=64
)
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)


def prompts(vocab: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, items: list[list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    """request id -> (tokens, chosen logprobs), every prompt at once."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for i, p in enumerate(items):
        engine.add_request(f"r{i}", p, PARAMS)
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens, lps = out.get(d.request_id, ([], []))
            lps = lps + [lp[t] for t, lp in zip(d.new_token_ids, d.new_logprobs)]
            out[d.request_id] = (tokens + d.new_token_ids, lps)
    return out


def assert_same_runs(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for rid in expected:
        assert_same_tokens_and_logprobs(*got[rid], *expected[rid], rid)


def test_prefix_cache_on_matches_off_with_hits(gdn_models):
    model_dir, hf = gdn_models("qwen3_5_moe")
    vocab = hf.config.vocab_size
    shared = prompts(vocab, 1, (70,))[0]
    items = [shared + p for p in prompts(vocab, 2, (5, 9, 13, 71))]
    off = LLM(model_dir, **ARGS, enable_prefix_caching=False).generate(items, PARAMS)
    on = LLM(model_dir, **ARGS, cpu_padded_decode=True)
    padded = []
    runner = on.engine.graph_runner
    original = runner.forward
    runner.forward = lambda sched: (padded.append(sched.num_decode_seqs), original(sched))[1]
    outs = on.generate(items[:1], PARAMS) + on.generate(items[1:], PARAMS)
    assert 3 in padded  # a batch of 3 decodes padded to the captured size 4
    assert_same_outputs(outs, off)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    again = on.generate(items[3:], PARAMS)  # its own prompt now cached up to 128 tokens
    assert again[0].num_cached_tokens == 128
    assert_same_outputs(again, off[3:])
    stats = on.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def disagg_config(role: str) -> DisaggConfig:
    return DisaggConfig(
        role=role,
        host="127.0.0.1",
        port=0,
        secret=SECRET.encode(),
        bootstrap_timeout_s=60.0,
        transfer_timeout_s=60.0,
        heartbeat_interval_s=0.2,
        lease_timeout_s=60.0,
        max_rooms_per_peer=64,
        transfer_backend="zmq",
    )


@pytest.fixture(scope="module")
def workers(gdn_models):
    """(role, tp size) -> its worker for Qwen3-Next, built on first use, closed at the end."""
    model_dir, _ = gdn_models("qwen3_next_moe")
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_ENV, SECRET)
    context = zmq.Context()
    built: dict[tuple[str, int], PrefillWorker | DecodeWorker] = {}

    def get(role: str, size: int):
        if (role, size) not in built:
            engine = Engine(
                model_dir,
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


def run_pair(prefill, decoder, items, tag: str) -> dict[str, tuple[list[int], list[float]]]:
    got: dict[str, tuple[list[int], list[float]]] = {}
    for i, p in enumerate(items):
        room = f"{tag}-{i}"
        decoder.add_request(f"r{i}", p, PARAMS, room=room, prefill_addr=prefill.address)
        prefill.add_request(f"r{i}", p, PARAMS, room=room)
    for _ in range(100_000):
        if not (decoder.has_unfinished_requests() or prefill.has_unfinished_requests()):
            break
        prefill.step()
        for d in decoder.step():
            tokens, lps = got.get(d.request_id, ([], []))
            lps = lps + [lp[t] for t, lp in zip(d.new_token_ids, d.new_logprobs)]
            got[d.request_id] = (tokens + d.new_token_ids, lps)
    assert decoder.take_failures() == [] and prefill.take_failures() == []
    for worker in (prefill, decoder):
        stats = worker.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    return got


@pytest.fixture(scope="module")
def colocated(gdn_models):
    """(first round's prompts, second round's, what a colocated TP=1 engine answers to each)."""
    model_dir, hf = gdn_models("qwen3_next_moe")
    items = prompts(hf.config.vocab_size, 3, (9, 70, 131))
    again = [p + [7, 8, 9] for p in items]
    engine = Engine(model_dir, **ARGS, enable_prefix_caching=False)
    return items, again, run(engine, items), run(engine, again)


@pytest.mark.parametrize("sizes", [(1, 1), (2, 1), (1, 2)])
def test_pd_pair_matches_colocated(workers, colocated, sizes):
    items, again, expected, expected_again = colocated
    prefill, decoder = workers("prefill", sizes[0]), workers("decode", sizes[1])
    hits = [w.stats().prefix_cache_hit_tokens for w in (prefill, decoder)]
    assert_same_runs(run_pair(prefill, decoder, items, f"a{sizes}"), expected)
    assert_same_runs(run_pair(prefill, decoder, again, f"b{sizes}"), expected_again)
    # the second round resumed from GDN checkpoints on both workers
    assert all(w.stats().prefix_cache_hit_tokens > h for w, h in zip((prefill, decoder), hits))


def test_tensor_parallel_matches_one_rank(gdn_models):
    model_dir, hf = gdn_models("olmo_hybrid_nope")
    items = prompts(hf.config.get_text_config().vocab_size, 4, (11, 80))
    expected = run(Engine(model_dir, **ARGS), items)
    engine = Engine(model_dir, tensor_parallel_size=2, **ARGS)
    try:
        assert_same_runs(run(engine, items), expected)
    finally:
        engine.close()


@pytest.mark.parametrize("role", ["prefill", "decode", None])
def test_a_tp_size_the_heads_cannot_split_is_refused_by_key(gdn_models, role):
    model_dir, _ = gdn_models("qwen3_next_mixed")  # 3 key and value heads
    connector = {} if role is None else dict(handover_connector=connector_spec(role, "127.0.0.1"))
    with pytest.raises(ConfigError, match="linear_num_key_heads=3"):
        Engine(model_dir, tensor_parallel_size=2, **connector, **ARGS)
