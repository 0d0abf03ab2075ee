"""Continuous batching: which requests run this step and how many tokens each feeds.

Plain Python over host data; unit-tested with fake model outputs (no model).

One step:
  1. running requests in admission order: a decode (one token) or the next prefill chunk
     (at most `chunked_prefill_size`), while the step's token budget lasts;
  2. waiting requests are admitted (FIFO) while the budget, `max_running_requests`, a free Mamba
     slot and KV pages for their first chunk allow.
When the KV pool runs dry, the most recently admitted request not yet scheduled this step is
preempted by recompute: its pages and slot are freed and it goes back to the front of the
waiting queue with its generated tokens kept (they are re-fed as prompt on resumption).
The batch lists decode sequences first, then prefill chunks (the order the model expects).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.forward_metadata import ScheduledBatch
from engine.memory import IndexPool
from engine.outputs import FinishReason
from engine.request import Request, Status


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    chunked_prefill_size: int
    max_running_requests: int
    page_size: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pages: IndexPool,
        slots: IndexPool,
        reset_slot: Callable[[int], None],
    ):
        self.config = config
        self.pages = pages
        self.slots = slots
        self.reset_slot = reset_slot
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def find(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a request (stop, length or abort) and give back everything it holds."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        scheduled: set[int] = set()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 if req.num_remaining == 1 else min(req.num_remaining, cfg.chunked_prefill_size, budget)
            if not self._reserve_pages(req, req.num_computed + n, scheduled):
                continue  # req itself was preempted
            (decodes if req.num_remaining == 1 else prefills).append((req, n))
            scheduled.add(id(req))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < cfg.max_running_requests:
            req = self.waiting[0]
            n = min(req.num_remaining, cfg.chunked_prefill_size, budget)
            if self.slots.available == 0 or self.pages.available < self._pages_for(n):
                break
            self.waiting.popleft()
            req.mamba_slot = self.slots.alloc(1)[0]
            self.reset_slot(req.mamba_slot)
            req.status = Status.RUNNING
            self.running.append(req)
            self._reserve_pages(req, n, scheduled)
            (decodes if req.num_remaining == 1 else prefills).append((req, n))
            scheduled.add(id(req))
            budget -= n

        if not decodes and not prefills:
            return None
        return self._batch(decodes, prefills)

    def _batch(self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]) -> ScheduledBatch:
        rows = decodes + prefills
        input_ids: list[int] = []
        logits_seqs, prompt_logprob_seqs = [], []
        for s, (req, n) in enumerate(rows):
            input_ids.extend(req.all_ids[req.num_computed : req.num_computed + n])
            if req.num_computed + n == req.num_tokens:
                logits_seqs.append(s)
            if req.wants_prompt_logprobs and req.num_computed < len(req.prompt_ids):
                prompt_logprob_seqs.append(s)
        mode = "decode" if not prefills else ("extend" if not decodes else "mixed")
        return ScheduledBatch(
            mode=mode,
            request_ids=tuple(req.request_id for req, _ in rows),
            num_decode_seqs=len(decodes),
            input_ids=tuple(input_ids),
            seq_lens=tuple(n for _, n in rows),
            start_positions=tuple(req.num_computed for req, _ in rows),
            kv_pages=tuple(tuple(req.kv_pages) for req, _ in rows),
            mamba_slots=tuple(req.mamba_slot for req, _ in rows),
            logits_seqs=tuple(logits_seqs),
            prompt_logprob_seqs=tuple(prompt_logprob_seqs),
            has_mamba_track_mask=False,
            track_points=(),
        )

    # -- memory -----------------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    def _reserve_pages(self, req: Request, num_tokens: int, scheduled: set[int]) -> bool:
        """Make req hold pages for `num_tokens` tokens, preempting later requests if needed.
        Returns False if req itself had to be preempted."""
        need = self._pages_for(num_tokens) - len(req.kv_pages)
        while need > self.pages.available:
            victim = next(
                (r for r in reversed(self.running) if r is not req and id(r) not in scheduled), None
            )
            if victim is None:
                self.preempt(req)
                return False
            self.preempt(victim)
        if need > 0:
            req.kv_pages.extend(self.pages.alloc(need))
        return True

    def preempt(self, req: Request) -> None:
        """Preemption by recompute: drop all cached state; resume from scratch later."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.kv_pages:
            self.pages.free(req.kv_pages)
            req.kv_pages = []
        if req.mamba_slot:
            self.slots.free([req.mamba_slot])
            req.mamba_slot = 0
