"""Scheduler unit tests on fake model outputs: no model, plain host data."""

from __future__ import annotations

from baton.engine.cache.memory import IndexPool
from baton.engine.core.outputs import SampledTokens
from baton.engine.core.request import Request, Status
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.core.scheduler import Scheduler, SchedulerConfig


class RecordedSlotOps:
    """The scheduler's slot operations, recorded instead of applied to pools."""

    def __init__(self) -> None:
        self.resets: list[int] = []
        self.copies: list[tuple[int, int]] = []

    def reset(self, slot: int) -> None:
        self.resets.append(slot)

    def copy(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))


def make(
    budget=32,
    chunk=16,
    max_running=8,
    pages=64,
    slots=8,
    page_size=4,
    policy="mixed",
    prefill_budget=None,
    page_window=None,
    page_tables=1,
):
    ops = RecordedSlotOps()
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            chunked_prefill_size=chunk,
            max_running_requests=max_running,
            page_size=page_size,
            page_tables=page_tables,
            page_window=page_window,
            policy=policy,
            max_prefill_tokens=prefill_budget or budget,
            max_model_len=4096,
            eos_token_ids=(0,),
        ),
        IndexPool(pages, "pages"),
        IndexPool(slots, "slots"),
        ops,
    )
    return sched, ops.resets


def req(rid, n, max_tokens=4):
    return Request(
        request_id=rid,
        prompt_ids=list(range(3, 3 + n)),
        params=SamplingParams(max_tokens=max_tokens),
        arrival=0,
    )


def fake_step(sched: Scheduler):
    """Run one step on fake model output: token 7 wherever one is sampled."""
    batch = sched.schedule()
    if batch is None:
        return None
    sched.update_from_output(
        batch, {s: SampledTokens((7,), (None,)) for s in batch.logits_seqs}, {}, {}
    )
    return batch


def test_budget_and_chunking():
    sched, reset = make(budget=20, chunk=8)
    for i, n in enumerate([30, 5, 3]):
        sched.add(req(f"r{i}", n))
    batch = sched.schedule()
    assert sum(batch.seq_lens) <= 20
    assert batch.seq_lens == (8, 5, 3)  # the long prompt is chunked, the others fit whole
    assert batch.start_positions == (0, 0, 0)
    assert batch.logits_seqs == (1, 2)  # only requests whose prompt is complete sample
    assert len(reset) == 3  # every admitted request starts from a zeroed Mamba slot


def test_decodes_come_first_and_mixed_batches_form():
    sched, _ = make(budget=16, chunk=16)
    sched.add(req("short", 3, max_tokens=10))
    fake_step(sched)  # prefill of "short" samples its first token
    sched.add(req("long", 40))
    batch = fake_step(sched)
    assert batch.mode == "mixed"
    assert batch.request_ids[0] == "short" and batch.num_decode_seqs == 1
    assert batch.seq_lens == (1, 15)


def test_preemption_picks_latest_admitted_and_recomputes():
    sched, _ = make(budget=64, chunk=64, pages=6, page_size=4)  # 24 token slots
    a, b = req("a", 8, max_tokens=14), req("b", 8, max_tokens=14)  # 22 tokens each, 44 > 24
    sched.add(a)
    sched.add(b)
    fake_step(sched)
    for _ in range(12):
        fake_step(sched)
        if sched.num_preemptions:
            break
    assert sched.num_preemptions >= 1
    assert (
        b.status is Status.WAITING
        and b.num_computed == 0
        and b.kv_pages == []
        and b.mamba_slot == 0
    )
    assert a.status is Status.RUNNING
    assert sched.waiting[0] is b and b.output_ids  # generated tokens kept for recompute
    while sched.has_work():
        fake_step(sched)
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.pages.used == 0 and sched.slots.used == 0


def test_max_running_requests_and_slot_limit():
    sched, _ = make(max_running=2, slots=8)
    for i in range(4):
        sched.add(req(f"r{i}", 4))
    batch = sched.schedule()
    assert len(batch.request_ids) == 2 and len(sched.waiting) == 2
    sched2, _ = make(max_running=8, slots=1)
    for i in range(3):
        sched2.add(req(f"r{i}", 4))
    assert len(sched2.schedule().request_ids) == 1


def test_abort_frees_pages_and_slot_everywhere():
    sched, _ = make(max_running=1)
    running, waiting = req("run", 10), req("wait", 10)
    sched.add(running)
    sched.add(waiting)
    fake_step(sched)
    assert sched.pages.used > 0 and sched.slots.used == 1
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert sched.pages.used == 0 and sched.slots.used == 0 and not sched.has_work()
    assert sched.schedule() is None


def _two_decoding_and_one_new(policy):
    sched, _ = make(budget=32, chunk=16, policy=policy)
    for rid in ("a", "b"):
        sched.add(req(rid, 3, max_tokens=10))
    fake_step(sched)  # both prefill and sample their first token: now decoding
    sched.add(req("new", 12))
    return sched


def test_mixed_policy_runs_decodes_beside_a_new_prefill():
    sched = _two_decoding_and_one_new("mixed")
    batch = fake_step(sched)
    assert batch.request_ids == ("a", "b", "new") and batch.num_decode_seqs == 2


def test_prefill_first_runs_a_waiting_prefill_without_the_decodes():
    sched = _two_decoding_and_one_new("prefill-first")
    batch = fake_step(sched)
    assert batch.mode == "extend"
    assert batch.request_ids == ("new",) and batch.seq_lens == (12,)
    # nothing waits now: the next step decodes all three, none was dropped
    batch = fake_step(sched)
    assert batch.mode == "decode" and batch.request_ids == ("a", "b", "new")
    assert [len(sched.get(r).output_ids) for r in ("a", "b", "new")] == [2, 2, 2]


def test_prefill_first_keeps_chunking_running_prefills_while_others_wait():
    sched, _ = make(budget=16, chunk=8, policy="prefill-first")
    sched.add(req("dec", 3, max_tokens=10))
    fake_step(sched)
    sched.add(req("long", 20))
    sched.add(req("late", 4))
    batch = fake_step(sched)
    assert batch.request_ids == ("long", "late") and batch.seq_lens == (8, 4)
    batch = fake_step(sched)  # "late" is decoding, "long" has 12 to go, nothing waits
    assert batch.request_ids == ("dec", "late", "long") and batch.num_decode_seqs == 2


def test_prefill_first_decodes_when_the_waiting_request_cannot_be_admitted():
    sched, _ = make(budget=32, chunk=16, max_running=2, policy="prefill-first")
    for rid in ("a", "b"):
        sched.add(req(rid, 3, max_tokens=3))
    fake_step(sched)
    sched.add(req("new", 5))  # max_running_requests is reached: it must wait for a finish
    batch = fake_step(sched)
    assert batch.mode == "decode" and batch.request_ids == ("a", "b")
    fake_step(sched)  # a and b reach max_tokens and finish
    batch = fake_step(sched)
    assert batch.request_ids == ("new",)
    assert not sched.waiting


def test_prefill_first_steps_keep_to_their_own_budget():
    sched, _ = make(budget=32, chunk=16, policy="prefill-first", prefill_budget=8)
    sched.add(req("dec", 3, max_tokens=10))
    sched.add(req("p1", 6))
    sched.add(req("p2", 6))
    batch = fake_step(sched)  # 8 tokens: dec whole, p1 cut to 5 (waiting: p2)
    assert batch.request_ids == ("dec", "p1") and batch.seq_lens == (3, 5)
    batch = fake_step(sched)  # p2 waits: prefills only, 8 tokens (p1's last 1 is a "decode")
    assert batch.request_ids == ("p2",) and batch.seq_lens == (6,)
    batch = fake_step(sched)  # nobody waits: the full budget, decodes included
    assert batch.request_ids == ("dec", "p1", "p2") and batch.seq_lens == (1, 1, 1)
