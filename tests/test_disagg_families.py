"""A disaggregated prefill/decode pair gives the colocated tokens and logprobs for every model
family (Bamba, Granite-4.0-H dense and MoE, Falcon-H1's parallel blocks, Zamba2's shared
attention blocks, Nemotron-3-style MoE, NemotronH with odd shapes) and odd page sizes, through
the prefix cache on both sides (the seed bug: a prefix hit on the prefill side must hand over
the state resumed from its checkpoint), late registration, first-token-only requests, and
preemption on either side; and a decode worker that loads another model, or the same config
with other weights, is refused by name instead of being handed garbage.

In-process pairs (tests/test_disagg_unit.py's helpers), and one `baton up` stack over HTTP; the
reference is a colocated engine with the prefix cache off (and transformers, for the first
prompt of each family).
"""

from __future__ import annotations

import copy
import math
import time

import httpx
import pytest
import torch
import zmq

from baton import SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.checkpoint.fingerprint import weights_fingerprint
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.models.registry import model_state_spec
from tests.conftest import TINY_CONFIGS
from tests.families import FAMILY_CONFIGS, save_family_model
from tests.reference import assert_greedy_matches, hf_greedy
from tests.same_outputs import assert_same_tokens_and_logprobs, chosen
from tests.test_disagg_unit import assert_pools_empty, config
from tests.tiny import save_tiny_model

# Every non-NemotronH family, a Nemotron-3-style MoE and NemotronH's odd shapes (attention
# first, one KV head, three groups, conv 3).
FAMILIES = [*FAMILY_CONFIGS, "moe_nano", "odd"]
# Pages that are not a power of two, and one token per page; 4 elsewhere.
PAGE_SIZE = {"bamba_b": 5, "granite_dense": 3, "zamba2_single": 1}
# Generous: these tests are about what the handover carries, not its timeouts.
SLOW_OK = dict(bootstrap_timeout_s=60.0, transfer_timeout_s=60.0)


def model(name, family_models, tiny_models):
    return family_models(name) if name in FAMILY_CONFIGS else tiny_models(name)


def chunk_size(model_dir) -> int:
    """The chunk grid of the model's recurrent state (its state spec's)."""
    return model_state_spec(ModelConfig.from_hf(model_dir), torch.float32).chunk_size


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


class Run:
    """Tokens, chosen logprobs and cached prompt tokens of each request through a pair."""

    def __init__(self, prefill: PrefillWorker, decoder: DecodeWorker) -> None:
        self.prefill, self.decoder = prefill, decoder
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.cached: dict[str, int] = {}

    def __call__(
        self,
        items,
        params: SamplingParams,
        late: bool = False,
        on_decode_side: bool = False,
        timeout: float = 60,
    ):
        """items: (request id, prompt). late: the prefill runs to its end before the decode side
        registers (its state waits as a snapshot); else the decode side registers first.
        on_decode_side: the decode worker serves them alone, as a colocated engine (from its
        prefix cache of transferred blocks, as when it recomputes a preempted request)."""
        prefill, decoder = self.prefill, self.decoder
        start = time.monotonic()
        if on_decode_side:
            for rid, prompt in items:
                decoder.add_request(rid, prompt, params)
        elif late:
            for rid, prompt in items:
                prefill.add_request(rid, prompt, params, room=f"room-{rid}")
            while prefill.computing():
                assert time.monotonic() - start < timeout, "the prefill did not finish"
                prefill.step()
        for rid, prompt in items if not on_decode_side else ():
            decoder.add_request(
                rid, prompt, params, room=f"room-{rid}", prefill_addr=prefill.address
            )
            if not late:
                prefill.add_request(rid, prompt, params, room=f"room-{rid}")
        while decoder.has_unfinished_requests() or prefill.has_unfinished_requests():
            assert time.monotonic() - start < timeout, "the pair did not finish"
            prefill.step()
            for delta in decoder.step():
                rid = delta.request_id
                self.tokens.setdefault(rid, []).extend(delta.new_token_ids)
                if delta.new_logprobs is not None:
                    self.logprobs.setdefault(rid, []).extend(
                        chosen(delta.new_token_ids, delta.new_logprobs)
                    )
                self.cached[rid] = delta.num_cached_tokens
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        return self


def colocated(engine: Engine, items, params: SamplingParams) -> tuple[dict, dict]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for rid, prompt in items:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.new_logprobs is not None:
                logprobs.setdefault(delta.request_id, []).extend(
                    chosen(delta.new_token_ids, delta.new_logprobs)
                )
    return tokens, logprobs


def assert_as_colocated(run: Run, reference: Engine, items, params: SamplingParams) -> None:
    tokens, logprobs = colocated(reference, items, params)
    for rid, prompt in items:
        where = f"{rid} ({len(prompt)} prompt tokens)"
        if params.logprobs is None:
            assert run.tokens.get(rid) == tokens[rid], f"{where}: tokens differ"
            continue
        assert_same_tokens_and_logprobs(
            run.tokens.get(rid, []), run.logprobs.get(rid, []), tokens[rid], logprobs[rid], where
        )


def pair(model_dir, ctx, prefill_args: dict, decode_args: dict) -> Run:
    prefill = PrefillWorker(Engine(model_dir, **prefill_args), config("prefill", **SLOW_OK), ctx)
    decoder = DecodeWorker(Engine(model_dir, **decode_args), config("decode", **SLOW_OK), ctx)
    return Run(prefill, decoder)


def close(run: Run) -> None:
    run.prefill.close()
    run.decoder.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_pair_matches_colocated_through_prefix_hits_on_both_sides(name, family_models, tiny_models):
    """Mixed lengths at once (one token, one page, many pages, more than a prefill chunk);
    then the same prompt again, prefixes that end exactly on a checkpoint and one token past
    it, and a shared prefix: the prefill side resumes from its checkpoints and the decode
    side from the blocks it cached at install; then a longer next turn registered only after
    its prefill ended, and a request the decode side serves alone from those blocks."""
    model_dir, hf = model(name, family_models, tiny_models)
    page = PAGE_SIZE.get(name, 4)
    interval = math.lcm(chunk_size(model_dir), page)
    vocab = hf.config.vocab_size
    whole = random_prompt(vocab, 3 * interval + 5, seed=1)
    other = random_prompt(vocab, 7, seed=2)
    rounds = [
        [("long", whole), ("one", [7]), ("page", whole[-page:]), ("many", other * 6)],
        [
            ("again", whole),
            ("on_block", whole[: 2 * interval]),  # the hit leaves the last block to compute
            ("past_block", whole[: 2 * interval + 1]),
            ("shared", whole[: 2 * interval] + other),
        ],
    ]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    cache = dict(page_size=page, mamba_track_interval=interval)
    run = pair(model_dir, zmq.Context(), cache | dict(chunked_prefill_size=interval + 3), cache)
    reference = Engine(model_dir, page_size=page, enable_prefix_caching=False)
    try:
        for items in rounds:
            run(items, params)
            assert_as_colocated(run, reference, items, params)
        assert run.prefill.stats().prefix_cache_hit_tokens >= 2 * interval
        assert run.cached["again"] >= 2 * interval  # the decode side's blocks of "long"
        next_turn = [("turn2", whole + run.tokens["long"] + other)]
        run(next_turn, params, late=True)
        assert_as_colocated(run, reference, next_turn, params)
        assert run.cached["turn2"] >= 3 * interval
        # The decode side's checkpoints of transferred blocks are true states: a request it
        # serves alone resumes from the one at the end of "long"'s second block.
        local = [("local", whole[: 2 * interval] + other[:3])]
        run(local, params, on_decode_side=True)
        assert_as_colocated(run, reference, local, params)
        assert run.cached["local"] == 2 * interval
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)
    ours, theirs = run.tokens["long"], hf_greedy(hf, whole, 8)
    assert_greedy_matches(ours, theirs[0], theirs[1], f"{name}: pair vs transformers")


@pytest.mark.parametrize("name", ["zamba2_shared", "falcon_mup", "moe_nano"])
def test_first_token_only_and_stops_on_it_match_colocated(name, family_models, tiny_models):
    """The prefill worker's token alone: max_tokens 1 with logprobs, a stop token and EOS hit
    on the first token (finished on install), and seeded sampling after it."""
    model_dir, hf = model(name, family_models, tiny_models)
    vocab = hf.config.vocab_size
    prompts = [("a", random_prompt(vocab, 5, seed=3)), ("b", random_prompt(vocab, 37, seed=4))]
    reference = Engine(model_dir, page_size=4, enable_prefix_caching=False)
    firsts, _ = colocated(reference, prompts, SamplingParams(max_tokens=1, temperature=0))
    eos = ModelConfig.from_hf(model_dir).eos_token_ids[0]
    cases = [
        SamplingParams(max_tokens=1, temperature=0, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0, logprobs=0, stop_token_ids=[firsts["a"][0]]),
        SamplingParams(max_tokens=6, temperature=0, logit_bias={eos: 100.0}),
        SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
    ]
    run = pair(model_dir, zmq.Context(), dict(page_size=4), dict(page_size=4))
    try:
        for i, params in enumerate(cases):
            items = [(f"{rid}{i}", prompt) for rid, prompt in prompts]
            run(items, params)
            assert_as_colocated(run, reference, items, params)
        assert run.tokens["a0"] == firsts["a"] and len(run.tokens["a1"]) == 1
        assert run.tokens["a2"] == run.tokens["b2"] == [eos]
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)


def test_preemption_on_either_side_matches_colocated(family_models):
    """Small pools on both sides: prefills preempted and run again, then (every state waiting
    as a snapshot, registered at once, so that the pressure does not depend on timing)
    decoding requests preempted on the decode side that recompute from the block checkpoints
    the prefill side handed over (Zamba2: a shared block used at several depths)."""
    model_dir, hf = family_models("zamba2_shared")
    chunk = chunk_size(model_dir)
    shared = random_prompt(hf.config.vocab_size, 2 * chunk + 3, seed=8)
    items = [
        (f"r{i}", shared + random_prompt(hf.config.vocab_size, n, seed=9 + i))
        for i, n in enumerate((20, 33, 41, 9, 50))
    ]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0)
    cache = dict(page_size=4, mamba_track_interval=chunk)
    small_prefill = dict(max_total_tokens=120, chunked_prefill_size=8, max_num_batched_tokens=32)
    run = pair(model_dir, zmq.Context(), cache | small_prefill, cache | dict(max_total_tokens=330))
    try:
        run(items, params, late=True, timeout=120)
        reference = Engine(model_dir, page_size=4, enable_prefix_caching=False)
        assert_as_colocated(run, reference, items, params)
        assert run.prefill.stats().num_preemptions > 0
        stats = run.decoder.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)


def refusal(prefill_dir, decode_dir) -> str:
    """The decode side's failure of one request between two workers; the prefill side drops
    the room too (a request still prefilling there fails with the same reason)."""
    ctx = zmq.Context()
    prefill = PrefillWorker(Engine(prefill_dir, page_size=4), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(decode_dir, page_size=4), config("decode"), ctx)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(3, 30))
    try:
        decoder.add_request("r", prompt, params, room="room", prefill_addr=prefill.address)
        prefill.add_request("r", prompt, params, room="room")
        start = time.monotonic()
        got = []
        while decoder.has_unfinished_requests() or prefill.has_unfinished_requests():
            # (a hang guard only: a refusal names the mismatch, a timeout would not)
            assert time.monotonic() - start < 60, "the pair hung"
            prefill.step()
            got += decoder.step()
        assert got == []  # not one token
        ((_, failure),) = decoder.take_failures()
        assert all(reason == f"room room: {failure}" for _, reason in prefill.take_failures())
        assert not prefill.rooms
        assert_pools_empty(prefill, decoder)
        return failure
    finally:
        prefill.close()
        decoder.close()


@pytest.mark.parametrize("name", ["zamba2_shared", "moe_nano"])
def test_same_config_with_other_weights_is_refused(name, family_models, tiny_models, tmp_path):
    """A fine-tune beside its base model (here: another seed) shares its config.json; its K/V
    pages and Mamba state would be decoded into garbage."""
    model_dir, _ = model(name, family_models, tiny_models)
    if name in FAMILY_CONFIGS:
        save_family_model(tmp_path, name, seed=999)
    else:
        save_tiny_model(tmp_path, seed=999, **TINY_CONFIGS[name])
    assert (tmp_path / "config.json").read_text() == (model_dir / "config.json").read_text()
    failure = refusal(model_dir, tmp_path)
    assert "weights differ" in failure and "same --model" in failure


@pytest.mark.parametrize(
    ("prefill_name", "decode_name", "named"),
    [
        # 5 vs 4 Mamba layers (3 vs 2 shared-block uses)
        (
            "zamba2_shared",
            "zamba2_single",
            "state differs: prefill worker has 'mamba2.conv: slot x5",
        ),
        # 4 vs 2 Mamba layers
        ("moe_nano", "moe_latent", "state differs: prefill worker has 'mamba2.conv: slot x4"),
    ],
)
def test_other_layouts_are_refused_naming_the_shapes(
    prefill_name, decode_name, named, family_models, tiny_models
):
    prefill_dir, _ = model(prefill_name, family_models, tiny_models)
    decode_dir, _ = model(decode_name, family_models, tiny_models)
    failure = refusal(prefill_dir, decode_dir)
    assert named in failure, failure


def test_weights_fingerprint_ignores_sharding_and_sees_an_edited_tensor(family_models, tmp_path):
    model_dir, hf = family_models("zamba2_shared")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert weights_fingerprint(tmp_path / "sharded") == weights_fingerprint(model_dir)
    edited = copy.deepcopy(hf)
    with torch.no_grad():
        edited.model.final_layernorm.weight[-1] += 1.0  # one value of one small tensor
    edited.save_pretrained(str(tmp_path / "edited"))
    assert weights_fingerprint(tmp_path / "edited") != weights_fingerprint(model_dir)


def test_baton_up_serves_zamba2_shared_blocks_as_colocated(family_models, tmp_path):
    """The whole stack over HTTP (`baton up`: prefill worker, decode worker, router): a prompt
    twice (the second a prefill-side prefix hit), a shared prefix with n=2 seeded samples,
    and max_tokens 1; texts and token logprobs as a colocated engine gives them."""
    from baton import LLM
    from tests.test_server_up import Stack

    model_dir, hf = family_models("zamba2_shared")
    whole = random_prompt(hf.config.vocab_size, 53, seed=1)
    other = random_prompt(hf.config.vocab_size, 7, seed=2)
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    requests = [
        (whole, greedy),
        (whole, greedy),
        (whole[:32] + other, dict(greedy, n=2, temperature=0.8, seed=5)),
        (whole[:33], dict(max_tokens=1, temperature=0.0, logprobs=2)),
    ]
    reference = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    worker_flags = ("--page-size", "4", "--mamba-track-interval", "16")
    stack = Stack(
        model_dir, tmp_path / "up.log", "--", *worker_flags, "--chunked-prefill-size", "20"
    )
    try:
        for prompt, fields in requests:
            body = {"prompt": prompt, **fields}
            answer = httpx.post(
                f"http://127.0.0.1:{stack.port}/v1/completions", json=body, timeout=60
            )
            assert answer.status_code == 200, answer.text
            expected = reference.generate([prompt], SamplingParams(**fields))
            choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
            assert len(choices) == len(expected)
            for choice, output in zip(choices, expected):
                assert choice["text"] == output.text
                want = chosen(output.token_ids, output.logprobs)
                got = choice["logprobs"]["token_logprobs"]
                assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]
