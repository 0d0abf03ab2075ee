"""Tensor parallelism on the CPU (gloo, two processes): TP=2 gives TP=1's greedy tokens and
logprobs (within 1e-4: the all-reduces sum in another order) through chunked prefill,
preemption and prefix-cache hits, with every rank's decode steps captured as CPU plans and
replayed (engine/executor/cpu_plan.py), on tiny NemotronH shapes that cover every sharding rule:

    single_group: n_groups = 1 (B/C replicated, the gated norm all-reduces its variance),
                  1 KV head for 2 ranks (replicated), tied vocab-parallel embeddings, odd vocab
    moe:          n_groups = 2 and 2 KV heads (both split), MoE experts and shared expert split

One TP=1 and one TP=2 engine per shape serve every case of this file.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.executor.draft_batch import DraftBatch
from baton.engine.executor.forward_metadata import ScheduledBatch, TrackPoint
from baton.engine.layers.mamba2 import mamba_shard
from baton.engine.parallel import TensorParallel, kv_head_part
from baton.engine.parallel.messages import (
    CopySlot,
    DropShard,
    InstallShard,
    RankShutdown,
    RankStep,
    ReportPools,
    ResetSlot,
    SendShard,
    SnapshotShard,
    UseGraphs,
    decode,
    encode,
    pool_digest,
)
from baton.engine.parallel.support import check_tp_supported
from tests.tiny import save_tiny_model

SHAPES = {
    "single_group": dict(
        n_groups=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        vocab_size=301,
        hybrid_override_pattern="M*-M-M*",
    ),
    "moe": dict(
        hybrid_override_pattern="MEM*EME",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        routed_scaling_factor=2.5,
    ),
}

# Small pools so that the batch below preempts; checkpoints every 16 tokens so that the second
# round hits the prefix cache; chunks of 16 so that every prompt is prefilled in pieces.
ENGINE_ARGS = dict(
    page_size=4,
    max_num_batched_tokens=32,
    chunked_prefill_size=16,
    max_total_tokens=112,
    max_mamba_slots=4,
    mamba_track_interval=16,
)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    built: dict[str, tuple[LLM, LLM]] = {}

    def get(name: str) -> tuple[LLM, LLM]:
        if name not in built:
            path = tmp_path_factory.mktemp(f"tp-{name}")
            save_tiny_model(path, seed=3, tokenizer=False, **SHAPES[name])
            built[name] = (
                LLM(path, **ENGINE_ARGS),
                LLM(path, tensor_parallel_size=2, **ENGINE_ARGS),
            )
        return built[name]

    yield get
    for _, tp2 in built.values():
        tp2.close()


def _assert_same(outs_1, outs_2) -> None:
    for one, two in zip(outs_1, outs_2, strict=True):
        assert two.token_ids == one.token_ids
        for lp_1, lp_2 in zip(one.logprobs, two.logprobs, strict=True):
            assert lp_2.keys() == lp_1.keys()
            for token, value in lp_1.items():
                assert abs(lp_2[token] - value) <= 1e-4, (token, value, lp_2[token])


@pytest.mark.parametrize("name", list(SHAPES))
def test_tp2_matches_tp1_through_chunks_preemption_and_cache_hits(engines, name):
    tp1, tp2 = engines(name)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    first = _prompts(0, (5, 40, 63, 77))
    # Round 2 shares round 1's prefixes: the prefix cache resumes from Mamba checkpoints.
    second = [p[:48] + q for p, q in zip(first[1:], _prompts(1, (9, 20, 3)))]
    for prompts in (first, second):
        _assert_same(tp1.generate(prompts, params), tp2.generate(prompts, params))
    s1, s2 = tp1.stats(), tp2.stats()
    # Both engines' decode steps were captured and replayed (rank 0's and rank 1's plans: their
    # all-reduces and the logits' gather are operators the plans replay; a plan that skipped one
    # would leave rank 0's logits apart from TP=1's, or hang the ranks)
    for llm in (tp1, tp2):
        plans = llm.engine.graph_runner.plans
        assert plans and all(plan is not None for plan in plans.values()), plans
        assert llm.engine.graph_runner.num_replays > 0
    assert s2.num_preemptions == s1.num_preemptions > 0
    assert s2.prefix_cache_hit_tokens == s1.prefix_cache_hit_tokens > 0
    assert s2.kv_pages_used == 0 and s2.mamba_slots_used == 0


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_rank_pools_hold_its_slice_of_tp1_state(engines, name):
    """After the runs above (the same schedule on both engines, so the same slots and pages),
    every Mamba slot and KV token slot of every rank holds its heads' / segments' slice of the
    TP=1 pools: the slot resets and copies of preemption and cache hits reached every rank, in
    order, and nothing else changed them. Rank 0 is compared tensor by tensor, the others by
    the per-slot digests they send."""
    tp1, tp2 = engines(name)
    for llm in (tp1, tp2):
        llm.generate(_prompts(2, (30, 50)), SamplingParams(max_tokens=4, temperature=0.0))
    full, config = tp1.engine.cache, tp1.engine.model_config
    digests = tp2.engine.ranks.pool_digests(tp2.engine.cache)
    assert len(digests) == 2
    for rank, digest in enumerate(digests):
        tp = TensorParallel(rank=rank, size=2, group=None, timeout_s=0.0)
        # The weights' slices (tp_shard, parallel) and the state spec's must agree.
        mamba = mamba_shard(config.family.mamba, tp)
        attention = config.family.attention
        first_kv, kv_heads = kv_head_part(attention.num_kv_heads, attention.num_heads, tp)
        owned = {name: t.ranges(2, rank) for name, _, t in tp1.engine.state_spec.entries()}
        assert owned["mamba2.conv"] == mamba.conv_channels
        assert owned["mamba2.ssm"] == ((mamba.first_head, mamba.num_heads),)
        assert owned["attention.k"] == owned["attention.v"] == ((first_kv, kv_heads),)
        expected = SimpleNamespace(pools={})
        for name, pool in full.pools.items():
            units = torch.cat([torch.arange(s, s + n) for s, n in owned[name]])
            expected.pools[name] = pool.index_select(2, units)  # (layers, rows, units, ...)
        torch.testing.assert_close(digest, pool_digest(expected), atol=1e-3, rtol=1e-4)
        if rank == 0:
            shard = tp2.engine.cache
            for name, pool in expected.pools.items():
                torch.testing.assert_close(shard.pools[name], pool, atol=1e-4, rtol=1e-4)


def test_unsupported_groups_for_tp_size_are_refused_naming_both(tmp_path):
    save_tiny_model(tmp_path, tokenizer=False, n_groups=3, mamba_num_heads=6)
    with pytest.raises(ConfigError, match=r"n_groups=3 .*tensor-parallel size 2"):
        LLM(tmp_path, tensor_parallel_size=2)
    config = ModelConfig.from_hf(tmp_path)
    # 3 groups on 3 ranks: one each (the heads must divide too)
    hybrid = config.family
    six_heads = dataclasses.replace(hybrid.attention, num_heads=6, num_kv_heads=3)
    check_tp_supported(
        dataclasses.replace(config, family=dataclasses.replace(hybrid, attention=six_heads)), 3
    )
    with pytest.raises(ConfigError, match=r"num_attention_heads=4 .*tensor-parallel size 3"):
        check_tp_supported(config, 3)


def _every_field_set() -> ScheduledBatch:
    """A batch whose fields all differ from any zero/empty value, so that a field dropped on
    the way reads back differently."""
    return ScheduledBatch(
        mode="mixed",
        request_ids=("a", "b", "c"),
        num_decode_seqs=1,
        num_verify_seqs=1,
        input_ids=(7, 8, 9, 10, 11),
        seq_lens=(1, 2, 2),
        start_positions=(4, 3, 0),
        kv_pages=((1, 2), (4,), (3,)),
        mamba_slots=(5, 8, 6),
        verify_slots=((8, 9),),
        logits_seqs=(0, 1, 2),
        prompt_logprob_seqs=(1,),
        has_mamba_track_mask=True,
        track_points=(TrackPoint(seq_index=1, token_offset=1, dst_slot=7),),
        lora_slots=(-1,) * len(("a", "b", "c")),
    )


def test_every_field_of_the_step_message_round_trips():
    batch = _every_field_set()
    handover = (
        SnapshotShard(room="a", pages=(3, 1), slot=2, checkpoint_slots=(6, 8)),
        SendShard(
            room="a",
            first_page=1,
            first_block=1,
            num_blocks=1,
            decode_size=2,
            decode_addresses=("tcp://h:1", "x"),
        ),
        DropShard(room="b"),
        InstallShard(
            room="c",
            pages=(4,),
            slot=5,
            first_page=2,
            prefill_size=2,
            first_block=1,
            num_blocks=2,
            checkpoint_slots=(0, 9),
        ),
    )
    step = RankStep(ops=(ResetSlot(slot=3), CopySlot(src=4, dst=5), *handover), batch=batch)
    back = decode(encode(step))
    for sent, got in zip(step.ops, back.ops, strict=True):  # every field of every operation
        for field in dataclasses.fields(sent):
            assert getattr(got, field.name) == getattr(sent, field.name), field.name
            assert type(getattr(got, field.name)) is type(getattr(sent, field.name)), field.name
    assert back == step
    for field in dataclasses.fields(ScheduledBatch):
        value = getattr(back.batch, field.name)
        assert value == getattr(batch, field.name), field.name
        assert type(value) is type(getattr(batch, field.name)), field.name
    for field in dataclasses.fields(RankStep):
        assert getattr(back, field.name) == getattr(step, field.name), field.name
    assert decode(encode(RankStep(ops=(), batch=None))) == RankStep(ops=(), batch=None)
    draft = DraftBatch(batch=batch, hidden_from="target", hidden_rows=(0, 2, 4))
    assert decode(encode(RankStep(ops=(), batch=draft))).batch == draft
    assert decode(encode(RankShutdown(reason="done"))) == RankShutdown(reason="done")
    graphs = UseGraphs(max_bs=16, kv_capacity=2048, capture="cpu", verify_width=3)
    assert decode(encode(graphs)) == graphs
    assert decode(encode(ReportPools(reason="check"))) == ReportPools(reason="check")


def test_bf16_tp2_stays_within_bf16s_own_error_of_tp1(engines, tmp_path_factory):
    """In bf16, TP=2 differs from TP=1 by reduction order and, with n_groups == 1, one more
    rounding of the gated value in the fused decode path: its logprobs of the prompt tokens
    (prefill) and of the greedy tokens (decode, up to the first token where any run differs)
    stay as close to bf16 TP=1's as bf16 TP=1 itself is to fp32, plus a margin of about one
    bf16 step at these magnitudes."""
    fp32, _ = engines("single_group")
    path = tmp_path_factory.mktemp("tp-bf16")  # the same weights (same seed and shape)
    save_tiny_model(path, seed=3, tokenizer=False, **SHAPES["single_group"])
    prompts = _prompts(4, (12, 33))
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, logprobs=0)
    ref = fp32.generate(prompts, params)
    with LLM(path, dtype="bfloat16", tensor_parallel_size=2, **ENGINE_ARGS) as bf16_2:
        two = bf16_2.generate(prompts, params)
    one = LLM(path, dtype="bfloat16", **ENGINE_ARGS).generate(prompts, params)

    def chosen(out, decoded: int) -> list[float]:
        values = [next(iter(lp.values())) for lp in out.prompt_logprobs if lp]
        return values + [next(iter(lp.values())) for lp in out.logprobs[:decoded]]

    for r, a, b in zip(ref, one, two, strict=True):
        runs = list(zip(r.token_ids, a.token_ids, b.token_ids))
        decoded = next((i for i, t in enumerate(runs) if len(set(t)) > 1), len(runs)) + 1
        fp, lo, hi = chosen(r, decoded), chosen(a, decoded), chosen(b, decoded)
        own_error = max(abs(x - y) for x, y in zip(fp, lo, strict=True))
        tp_error = max(abs(x - y) for x, y in zip(lo, hi, strict=True))
        assert 0 < own_error < 0.5, own_error  # bf16 really rounds, and not wildly
        assert tp_error <= 2 * own_error + 2**-5, (tp_error, own_error)


def test_a_message_of_an_unknown_carrier_is_refused():
    import msgpack

    frame = msgpack.packb({"type": "Pickle", "fields": {}})
    with pytest.raises(ValueError, match="unknown rank message carrier 'Pickle'"):
        decode(frame)


def test_ranks_take_a_gpu_each_only_when_there_is_one_per_rank(monkeypatch):
    """NCCL needs a GPU per rank: with fewer GPUs than ranks every rank shares the named device
    (and the all-reduces stay on gloo); the CPU never changes."""
    from baton.engine.parallel import one_gpu_per_rank, rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert one_gpu_per_rank("cuda", 2)
    assert [rank_device("cuda", r, 2) for r in range(2)] == [
        torch.device("cuda", r) for r in (0, 1)
    ]
    assert not one_gpu_per_rank("cuda", 4)
    assert rank_device("cuda", 3, 4) == torch.device("cuda")
    assert not one_gpu_per_rank("cuda", 1) and rank_device("cuda:1", 0, 1) == torch.device("cuda:1")
    assert not one_gpu_per_rank("cpu", 2) and rank_device("cpu", 1, 2) == torch.device("cpu")


def test_a_closed_tp_engine_unregisters_its_group(tmp_path):
    """The functional collectives find the gloo group by name in torch's registry, which would
    keep the group (and its connections to the exited ranks) alive after the engine stops."""
    save_tiny_model(tmp_path, seed=3, tokenizer=False)
    llm = LLM(tmp_path, tensor_parallel_size=2)
    name = llm.engine.ranks.tp.group_name
    registry = torch._C._distributed_c10d
    assert registry._resolve_process_group(name) is not None
    llm.close()
    with pytest.raises(RuntimeError, match="Could not resolve the process group"):
        registry._resolve_process_group(name)
