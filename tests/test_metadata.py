"""The seed bug's cure: carriers without defaults, one builder that carries every field, and
tracking that really writes checkpoint slots."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.executor.forward_metadata import (
    ForwardBatch,
    ForwardMetadata,
    Mamba2Metadata,
    ScheduledBatch,
    TrackPoint,
    build_metadata,
)
from baton.engine.executor.graph_runner import DecodeGraphRunner, copy_from
from baton.engine.executor.metadata_buffers import MetadataBuffers
from baton.engine.executor.model_runner import ModelRunner

CARRIERS = [TrackPoint, ScheduledBatch, ForwardBatch, ForwardMetadata, Mamba2Metadata]
PAGE, CHUNK, CONV = 4, 8, 4


@pytest.mark.parametrize("carrier", CARRIERS)
def test_carriers_are_frozen_keyword_only_and_have_no_defaults(carrier):
    params = carrier.__dataclass_params__
    assert params.frozen
    assert hasattr(carrier, "__slots__")
    for field in dataclasses.fields(carrier):
        assert field.kw_only, f"{carrier.__name__}.{field.name} is positional"
        assert field.default is dataclasses.MISSING, (
            f"{carrier.__name__}.{field.name} has a default"
        )
        assert field.default_factory is dataclasses.MISSING, (
            f"{carrier.__name__}.{field.name} has a default"
        )
    with pytest.raises(TypeError):
        carrier()  # leaving any field out is an error, never a silent default


def scheduled(mode: str, track: bool) -> ScheduledBatch:
    """Decode rows, then verify rows (3 tokens each: the last one and 2 drafts), then prefill
    chunks starting at unaligned positions."""
    decode = mode in ("decode", "mixed", "verify")
    verify = mode in ("mixed", "verify")
    prefill = mode in ("extend", "mixed")
    rows = []  # (rid, tokens, start, pages, slot)
    if decode:
        rows += [("d0", [7], 12, (3, 4, 5, 6), 1), ("d1", [9], 5, (7, 8), 2)]
    verify_slots = ()
    if verify:
        rows += [
            ("v0", [11, 12, 13], 9, (26, 27, 28), 5),
            ("v1", [14, 15, 16], 30, tuple(range(29, 38)), 6),
        ]
        verify_slots = ((5, 9, 10), (6, 11, 12))
    if prefill:
        rows += [("p0", list(range(10, 31)), 3, (9, 10, 11, 12, 13, 14, 15), 3)]
        rows += [("p1", list(range(40, 53)), 16, tuple(range(16, 25)), 4)]
    nd, nv = (2 if decode else 0), len(verify_slots)
    points = ()
    if track:
        points = tuple(
            ([TrackPoint(seq_index=0, token_offset=0, dst_slot=6)] if decode else [])
            + ([TrackPoint(seq_index=nd + nv, token_offset=4, dst_slot=7)] if prefill else [])
            + ([TrackPoint(seq_index=nd + nv + 1, token_offset=7, dst_slot=8)] if prefill else [])
        )
    return ScheduledBatch(
        mode=mode,
        request_ids=tuple(r[0] for r in rows),
        num_decode_seqs=nd,
        num_verify_seqs=nv,
        input_ids=tuple(t for r in rows for t in r[1]),
        seq_lens=tuple(len(r[1]) for r in rows),
        start_positions=tuple(r[2] for r in rows),
        kv_pages=tuple(r[3] for r in rows),
        mamba_slots=tuple(r[4] for r in rows),
        verify_slots=verify_slots,
        logits_seqs=tuple(range(len(rows))),
        prompt_logprob_seqs=(len(rows) - 1,) if prefill else (),
        has_mamba_track_mask=bool(points),
        track_points=points,
        # every row its own adapter slot or none (-1), so a lost or shifted slot shows
        lora_slots=tuple(i % 3 - 1 for i in range(len(rows))),
    )


def reconstruct(md: Mamba2Metadata, sched: ScheduledBatch) -> dict:
    """Read every ScheduledBatch field back out of the built metadata."""
    batch = md.forward.batch
    nd, nv = batch.num_decode_seqs, batch.num_verify_seqs
    q = md.verify_slots.shape[1] - 1 if nv else 0
    assert batch.num_verify_tokens == nv * q and md.forward.verify_attention.num_seqs == nv
    lens = [1] * nd + [q] * nv + md.chunk_layout.cu_seqlens.diff().tolist()
    starts = [kv - 1 for kv in md.forward.decode_attention.kv_lens.tolist()[:nd]]
    starts += [kv - q for kv in md.forward.verify_attention.kv_lens.tolist()]
    starts += md.chunk_layout.start_pos.tolist()
    pages = []
    slot_mapping = md.forward.slot_mapping.tolist()
    offset = 0
    for n, start, want in zip(lens, starts, sched.kv_pages):
        slots = slot_mapping[offset : offset + n]
        offset += n
        # Every page used by this step's tokens appears in the table at its position.
        for pos, slot in zip(range(start, start + n), slots):
            assert want[pos // PAGE] == slot // PAGE
        pages.append(want)
    owners = batch.logits_row_owner
    logits_seqs = sorted(set(owners))
    verifying = range(nd, nd + nv)
    prompt_seqs = sorted({s for s in owners if owners.count(s) > 1 and s not in verifying})
    assert all(owners.count(s) == q for s in verifying)  # a verify row's logits: all q rows
    points = []
    ndt = md.num_decode_tracks
    for i, dst in enumerate(md.track_state_dst.tolist()):
        if dst == 0:
            continue  # graph-capacity padding: dummy slot 0 onto itself
        conv = md.track_window_indices[i].item()
        if i < ndt:
            points.append(TrackPoint(seq_index=conv, token_offset=0, dst_slot=dst))
        else:
            token = conv
            cu = md.chunk_layout.cu_seqlens.tolist()
            s_p = max(j for j in range(len(cu) - 1) if cu[j] <= token)
            points.append(
                TrackPoint(seq_index=nd + nv + s_p, token_offset=token - cu[s_p], dst_slot=dst)
            )
    verify_table = md.verify_slots.tolist()
    return {
        "mode": batch.mode,
        "request_ids": sched.request_ids,  # host-only: the engine keeps it beside the metadata
        "num_decode_seqs": nd,
        "num_verify_seqs": nv,
        "input_ids": tuple(batch.input_ids.tolist()),
        "seq_lens": tuple(lens),
        "start_positions": tuple(starts),
        "kv_pages": tuple(pages),
        "mamba_slots": tuple(
            md.decode_slots.tolist() + [row[0] for row in verify_table] + md.prefill_slots.tolist()
        ),
        "verify_slots": tuple(tuple(row[1:]) for row in verify_table),
        "logits_seqs": tuple(logits_seqs),
        "prompt_logprob_seqs": tuple(prompt_seqs),
        "has_mamba_track_mask": md.has_mamba_track_mask,
        "track_points": tuple(points),
        # per token on the device: each sequence's first token's
        "lora_slots": tuple(
            batch.lora_slots.tolist()[start] for start in itertools.accumulate([0, *lens[:-1]])
        ),
    }


def build(sched):
    return build_metadata(
        sched,
        page_size=PAGE,
        page_tables=1,
        chunk_size=CHUNK,
        window_width=CONV,
        # Small on purpose: every build grows them (the path eager steps take).
        buffers=MetadataBuffers("cpu", ints=8, kv_rows=1, kv_width=4, fixed=False),
        decode_mask=True,
        kv_capacity=None,
        track_capacity=None,
    )


def check_builder_carries_every_field(
    builder, modes=("extend", "decode", "mixed", "verify")
) -> None:
    fields = {f.name for f in dataclasses.fields(ScheduledBatch)}
    for mode in modes:
        for track in (False, True):
            sched = scheduled(mode, track)
            got = reconstruct(builder(sched), sched)
            assert set(got) == fields, "the check must cover every ScheduledBatch field"
            for name in fields:
                assert got[name] == getattr(sched, name), f"{mode}/track={track}: field {name} lost"


def test_builder_carries_every_field_in_every_mode():
    check_builder_carries_every_field(build)


def graph_runner(kv_capacity: int = 64, verify_width: int | None = None) -> DecodeGraphRunner:
    fake = SimpleNamespace(
        cache=SimpleNamespace(
            page_size=PAGE,
            page_tables=1,
            chunk_size=CHUNK,
            window_width=CONV,
        ),
        device="cpu",
        buffers=MetadataBuffers("cpu", ints=8, kv_rows=1, kv_width=4, fixed=False),
        decode_reads_mask=lambda: True,
    )
    runner = DecodeGraphRunner(
        fake, max_bs=8, kv_capacity=kv_capacity, capture=None, verify_width=verify_width
    )
    runner.capture = "cuda"  # build with the static capacities a captured step uses
    return runner


def test_graph_path_builder_carries_every_field():
    """Padded to a capture size with static capacities, the real rows keep every field."""
    runner = graph_runner()

    def padded_build(sched):
        md = runner.build(runner.pad(sched, 8))
        assert md.forward.decode_attention.max_kv == 64 and md.track_state_dst.shape[0] in (0, 8)
        real = sched.num_seqs
        return dataclasses.replace(
            md,
            forward=dataclasses.replace(
                md.forward,
                batch=dataclasses.replace(
                    md.forward.batch,
                    num_decode_seqs=real,
                    input_ids=md.forward.batch.input_ids[:real],
                    logits_row_owner=md.forward.batch.logits_row_owner[:real],
                ),
                slot_mapping=md.forward.slot_mapping[:real],
                decode_attention=md.forward.decode_attention._replace(
                    kv_lens=md.forward.decode_attention.kv_lens[:real]
                ),
            ),
            decode_slots=md.decode_slots[:real],
        )

    check_builder_carries_every_field(padded_build, modes=("decode",))
    with pytest.raises(AssertionError):
        check_builder_carries_every_field(
            lambda sched: dataclasses.replace(padded_build(sched), has_mamba_track_mask=False),
            modes=("decode",),
        )


@pytest.mark.parametrize(
    "breakage",
    [
        lambda md: dataclasses.replace(md, has_mamba_track_mask=False),  # the seed bug itself
        lambda md: dataclasses.replace(
            md,
            track_state_dst=md.track_state_dst[:0],
            track_state_src=md.track_state_src[:0],
            track_window_indices=md.track_window_indices[:0],
            num_decode_tracks=0,
        ),
        lambda md: dataclasses.replace(md, prefill_slots=torch.zeros_like(md.prefill_slots)),
        lambda md: dataclasses.replace(md, verify_slots=torch.zeros_like(md.verify_slots)),
    ],
)
def test_field_check_catches_a_broken_builder(breakage):
    with pytest.raises(AssertionError):
        check_builder_carries_every_field(lambda sched: breakage(build(sched)))


def test_tracking_writes_true_states_into_checkpoint_slots(base_model):
    """With the flag set, checkpoint slots receive the conv window and SSM state at the tracked
    positions; they equal the working state of a run that stopped exactly there."""
    model_dir, _ = base_model
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu")
    cs = config.family.mamba.chunk_size
    tokens = torch.randint(
        3, config.vocab_size, (3 * cs + 5,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    pages = tuple(range(1, 20))

    def fresh():
        cache = StateCache.for_model(
            config,
            num_pages=24,
            page_size=PAGE,
            num_slots=8,
            dtype=torch.float32,
            device="cpu",
        )
        return cache, ModelRunner(model, cache, "cpu")

    def batch(toks, start, points):
        return ScheduledBatch(
            mode="extend",
            request_ids=("r",),
            num_decode_seqs=0,
            num_verify_seqs=0,
            input_ids=tuple(toks),
            seq_lens=(len(toks),),
            start_positions=(start,),
            kv_pages=(pages,),
            mamba_slots=(1,),
            verify_slots=(),
            logits_seqs=(0,),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=bool(points),
            track_points=points,
            lora_slots=(-1,) * len(("r",)),
        )

    # Start mid-chunk (position 5) so the first chunk is short; track at 2*cs and 3*cs.
    cache, runner = fresh()
    runner.forward(batch(tokens[:5], 0, ()))
    points = (
        TrackPoint(seq_index=0, token_offset=2 * cs - 5 - 1, dst_slot=3),
        TrackPoint(seq_index=0, token_offset=3 * cs - 5 - 1, dst_slot=4),
    )
    runner.forward(batch(tokens[5:], 5, points))
    for dst, end in ((3, 2 * cs), (4, 3 * cs)):
        ref_cache, ref_runner = fresh()
        ref_runner.forward(batch(tokens[:end], 0, ()))
        torch.testing.assert_close(
            cache.pools["mamba2.ssm"][:, dst],
            ref_cache.pools["mamba2.ssm"][:, 1],
            atol=1e-5,
            rtol=1e-5,
        )
        torch.testing.assert_close(
            cache.pools["mamba2.conv"][:, dst], ref_cache.pools["mamba2.conv"][:, 1]
        )
    # Without the flag nothing is written.
    cache2, runner2 = fresh()
    runner2.forward(batch(tokens, 0, ()))
    assert (
        cache2.pools["mamba2.ssm"][:, 3].abs().sum() == 0
        and cache2.pools["mamba2.conv"][:, 3].abs().sum() == 0
    )
    # A decode-time checkpoint copies the working state after the step.
    decode = ScheduledBatch(
        mode="decode",
        request_ids=("r",),
        num_decode_seqs=1,
        num_verify_seqs=0,
        input_ids=(5,),
        seq_lens=(1,),
        start_positions=(len(tokens),),
        kv_pages=(pages,),
        mamba_slots=(1,),
        verify_slots=(),
        logits_seqs=(0,),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=True,
        track_points=(TrackPoint(seq_index=0, token_offset=0, dst_slot=5),),
        lora_slots=(-1,) * len(("r",)),
    )
    runner2.forward(decode)
    torch.testing.assert_close(cache2.pools["mamba2.ssm"][:, 5], cache2.pools["mamba2.ssm"][:, 1])
    torch.testing.assert_close(cache2.pools["mamba2.conv"][:, 5], cache2.pools["mamba2.conv"][:, 1])
    assert cache2.pools["mamba2.ssm"][:, 5].abs().sum() > 0


def test_track_flag_must_match_track_points():
    sched = dataclasses.replace(scheduled("mixed", True), has_mamba_track_mask=False)
    with pytest.raises(ValueError, match="has_mamba_track_mask"):
        build(sched)


def test_verify_attention_is_the_layout_of_q_causal_queries():
    """The verify segment's layout, built on the device from pages like the decode one, is what
    the kernels' own builder gives for q queries per sequence over the paged prefix."""
    from baton.kernels.attention import build_attention_layout

    sched = scheduled("verify", track=False)
    got = build(sched).forward.verify_attention
    nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
    q = sched.seq_lens[nd]
    kv_lens = [sched.start_positions[s] + q for s in range(nd, nd + nv)]
    width = max(len(sched.kv_pages[s]) for s in range(nd, nd + nv)) * PAGE
    table = torch.zeros(nv, width, dtype=torch.int64)
    for v in range(nv):
        for pos in range(kv_lens[v]):
            table[v, pos] = sched.kv_pages[nd + v][pos // PAGE] * PAGE + pos % PAGE
    want = build_attention_layout([q] * nv, kv_lens, table, "cpu")
    assert (got.num_seqs, got.max_q, got.max_kv) == (want.num_seqs, want.max_q, want.max_kv)
    for name in ("query_start_loc", "kv_lens", "q_slot", "slot_q", "mask"):
        assert torch.equal(getattr(got, name).long(), getattr(want, name).long()), name
    for v, n in enumerate(kv_lens):
        assert torch.equal(got.kv_indices[v, :n], want.kv_indices[v, :n])


def only_verify_rows(sched: ScheduledBatch) -> ScheduledBatch:
    nd = sched.num_decode_seqs
    return dataclasses.replace(
        sched,
        mode="verify",
        request_ids=sched.request_ids[nd:],
        num_decode_seqs=0,
        input_ids=sched.input_ids[nd:],
        seq_lens=sched.seq_lens[nd:],
        start_positions=sched.start_positions[nd:],
        kv_pages=sched.kv_pages[nd:],
        mamba_slots=sched.mamba_slots[nd:],
        lora_slots=sched.lora_slots[nd:],
        logits_seqs=tuple(range(sched.num_seqs - nd)),
    )


def test_padded_verify_step_replays_into_the_captured_metadata():
    """A verify step (every row verifying its drafts) padded to a capture size, with the static
    capacities and fixed buffers of a CUDA graph: its metadata has every shape and host value of
    the all-padding batch the graph captured (copy_from, what a replay does, refuses any
    difference), its real rows are the eager build's, and padding stays on dummy page 0 and
    slot 0."""
    runner = graph_runner(kv_capacity=64, verify_width=3)
    runner.buffers = runner.static_buffers()
    sched = only_verify_rows(scheduled("verify", track=False))
    nv, q = sched.num_seqs, 3
    assert runner.can_run(sched)
    static = runner.build(runner.dummy_batch("verify", 4, False, lora=True))  # rows 0, 2 have one
    md = runner.build(runner.pad(sched, 4))
    copy_from(static, md)
    eager = build(sched)
    real = nv * q
    got, want = md.forward, eager.forward
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got.batch, name)[:real], getattr(want.batch, name)), name
    assert torch.equal(got.slot_mapping[:real], want.slot_mapping)
    assert torch.equal(md.verify_slots[:nv], eager.verify_slots)
    assert torch.equal(got.verify_attention.kv_lens[:nv], want.verify_attention.kv_lens)
    for v in range(nv):
        n = int(want.verify_attention.kv_lens[v])
        assert torch.equal(
            got.verify_attention.kv_indices[v, :n], want.verify_attention.kv_indices[v, :n]
        )
        assert torch.equal(
            got.verify_attention.mask[v, ..., :n], want.verify_attention.mask[v, ..., :n]
        )
        assert not got.verify_attention.mask[v, ..., n:].any()
    # padding rows: positions 0 .. q - 1 of dummy page 0, every state slot the dummy slot 0
    assert got.slot_mapping[real:].tolist() == list(range(q)) * (4 - nv)
    assert md.verify_slots[nv:].unique().tolist() == [0]
    assert got.verify_attention.max_kv == 64
    # a live request on the dummy slot is refused
    with pytest.raises(AssertionError, match="dummy slot"):
        runner.pad(dataclasses.replace(sched, verify_slots=((5, 0, 10), (6, 11, 12))), 4)


def test_verify_steps_the_padded_runner_leaves_to_eager():
    sched = only_verify_rows(scheduled("verify", track=False))
    assert graph_runner(verify_width=3).can_run(sched)
    assert not graph_runner(verify_width=None).can_run(sched)  # not speculating
    # drafts wider than a page: the padding rows would not fit dummy page 0
    assert graph_runner(verify_width=PAGE + 1).verify_width is None
    # plain decode rows beside the verify rows: eager (no graph per pair of sizes)
    assert not graph_runner(verify_width=3).can_run(scheduled("verify", track=False))


@pytest.mark.parametrize("mode", ["decode", "verify", "mixed", "extend"])
def test_with_tokens_equals_building_the_draft_batch(mode):
    """An MTP head's first pass reuses its step's metadata with other tokens and logits rows:
    what it reads equals a fresh build of that batch."""
    from baton.engine.executor.draft_metadata import same_rows, with_tokens

    sched = scheduled(mode, track=False)
    draft = dataclasses.replace(
        sched,
        input_ids=tuple(t + 1 for t in sched.input_ids),
        logits_seqs=sched.logits_seqs[::2],
        prompt_logprob_seqs=(),
    )
    assert same_rows(sched, draft)
    got, want = with_tokens(build(sched), draft), build(draft)
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got.forward.batch, name), getattr(want.forward.batch, name))
    assert got.forward.batch.logits_row_owner == want.forward.batch.logits_row_owner
    assert torch.equal(got.forward.slot_mapping, want.forward.slot_mapping)
    for segment in ("decode_attention", "verify_attention", "prefill_attention"):
        a, b = getattr(got.forward, segment), getattr(want.forward, segment)
        for field in ("query_start_loc", "kv_lens", "kv_indices", "mask"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (segment, field)
    moved = dataclasses.replace(draft, start_positions=(0,) + draft.start_positions[1:])
    assert not same_rows(sched, moved)
