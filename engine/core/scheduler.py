"""Continuous batching: which requests run this step and how many tokens each feeds.

Plain Python over host data; unit-tested with fake model outputs (no model).

One step:
  1. running requests in admission order: a decode (one token) or the next prefill chunk
     (at most `chunked_prefill_size`), while the step's token budget lasts;
  2. waiting requests are admitted (FIFO) while the budget, `max_running_requests`, a free Mamba
     slot and KV pages for their first chunk allow.
That is vLLM V1's schedule (policy "mixed"). Policy "prefill-first" is SGLang's default: while
requests wait, step 1 skips the decodes, so the step is prefill chunks only (running requests'
next chunks and new requests), within `max_prefill_tokens`; the decodes run in the next step
that has no prefill to run (a new request's first token sooner, running requests' next token
later). When no prefill can run (the waiting ones cannot be admitted), the step is the mixed one.
When the KV pool runs dry, the most recently admitted request not yet scheduled this step is
preempted by recompute: its pages and slot are freed and it goes back to the front of the
waiting queue with its generated tokens kept (they are re-fed as prompt on resumption).
The batch lists decode sequences first, then prefill chunks (the order the model expects).

With speculative decoding (engine/core/scheduler_spec.py), a decoding request with drafts feeds
its last token and its k drafts as one verify row (the batch is then decode rows, verify rows,
prefill chunks); `update_from_output` takes the accepted drafts and the token after them, rolls
the recurrent state back to the last accepted position and stores the next drafts.

With a prefix cache, admission first matches the prompt against cached blocks (sharing their KV
pages and starting from a copy of the deepest checkpoint), and every step marks the requests whose
tokens cross a multiple of `track_interval` (TrackPoints, plus the host flag
`has_mamba_track_mask`) so the forward checkpoints their state; `update_from_output` then registers the
new blocks (engine/core/scheduler_blocks.py). Under memory pressure idle cached blocks are evicted
before anything is preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from baton.engine.cache.memory import IndexPool, OutOfMemory
from baton.engine.cache.prefix_cache import PrefixCache
from baton.engine.core.outputs import FinishReason, RequestDelta, SampledTokens, TokenLogprobs
from baton.engine.core.request import Hold, Request, Status
from baton.engine.core.scheduler_blocks import PrefixBlocks
from baton.engine.core.scheduler_spec import SpecSchedule, Speculation
from baton.engine.core.scheduler_tokens import Appended, OutputConstraint, append_tokens, delta_of
from baton.engine.executor.forward_metadata import ScheduledBatch

SchedulePolicy = Literal["mixed", "prefill-first"]
SCHEDULE_POLICIES: tuple[str, ...] = get_args(SchedulePolicy)

# seq index in the batch -> the tokens it sampled (one, or accepted drafts and the next)
Sampled = dict[int, SampledTokens]
# seq index in the batch -> the drafts its next step verifies
Drafts = dict[int, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    chunked_prefill_size: int
    max_running_requests: int
    page_size: int | None  # None: the model keeps no paged state (requests hold no pages)
    policy: SchedulePolicy
    max_prefill_tokens: int  # token budget of a prefill-first step (<= max_num_batched_tokens)
    max_model_len: int  # a request that reaches it ends with "length"
    eos_token_ids: tuple[int, ...]


class SlotOps(Protocol):
    """What the scheduler does to a slot's state outside the forward (engine/parallel/messages.py's
    PoolOps applies it on every rank)."""

    def reset(self, slot: int) -> None: ...

    def copy(self, src: int, dst: int) -> None: ...


class Scheduler:
    """Owns every request and every change to its state: schedule -> (the executor runs the
    batch) -> update_from_output, as vLLM V1's engine core; plus the handover's scheduler half
    (reserve for a transfer, start a transferred request)."""

    def __init__(
        self,
        config: SchedulerConfig,
        pages: IndexPool,
        slots: IndexPool,
        slot_ops: SlotOps,
        prefix_cache: PrefixCache | None = None,
        constraint: OutputConstraint | None = None,
        speculation: SpecSchedule | None = None,
    ):
        self.config = config
        self.constraint = constraint
        self.pages = pages
        self.slots = slots
        self.slot_ops = slot_ops
        self.prefix_cache = prefix_cache
        self.blocks = PrefixBlocks(prefix_cache, pages, slots) if prefix_cache else None
        self.spec = (
            Speculation(
                speculation, slots, slot_ops, prefix_cache, self.blocks, config.max_model_len
            )
            if speculation is not None
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # What released requests still held (Request.hold): (hold, pages, slot, cached blocks)
        self.held: list[tuple[Hold, list[int], int, list]] = []
        # request id -> called with the finished Request before its pages and slot are freed
        # (the prefill side of a disaggregated pair snapshots it)
        self.finish_hooks: dict[str, Callable[[Request], None]] = {}

    # -- queue management -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.register(req)
        self.enqueue(req)

    def enqueue(self, req: Request) -> None:
        """A registered request waits for its first step (once what it waited on is ready: its
        grammar, for one with structured outputs)."""
        self.waiting.append(req)

    def register(self, req: Request) -> None:
        """The request is this scheduler's from now on (found, held, aborted by id)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.prompt_tokens_total += len(req.prompt_ids)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def speculating(self) -> bool:
        """Whether this step drafts and verifies: speculation is on and the requests in the
        engine (running, and waiting to: a burst fills the batch within a few steps) are fewer
        than `disable_by_batch_size`."""
        return self.spec is not None and self.spec.active(len(self.running) + len(self.waiting))

    def abort(self, request_id: str) -> None:
        self.finish_hooks.pop(request_id, None)
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")

    def finish(
        self, req: Request, reason: FinishReason, stop_reason: str | int | None = None
    ) -> None:
        """End a request (stop, length or abort) and give back everything it holds."""
        if req.finished:
            return
        if self.constraint is not None:
            self.constraint.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason

    def hold(self, request_id: str, hold: Hold) -> None:
        """Keep the request's pages and slot in place after it ends, until `hold.done`."""
        self.requests[request_id].hold = hold

    def release_held(self) -> None:
        """Give back the pages and slots of released requests whose holds are done."""
        if not self.held:
            return
        still = []
        for hold, pages, slot, blocks in self.held:
            if hold.done:
                self._free(pages, slot, blocks)
            else:
                still.append((hold, pages, slot, blocks))
        self.held = still

    # -- the handover's scheduler half ----------------------------------------------------------

    def reserve_for_transfer(self, req: Request) -> None:
        """Decode side of a disaggregated pair: a slot and pages for the prompt plus the first
        generated token, held while the prefill engine computes and sends them. Blocks of the
        prompt this engine already caches are shared, not reserved (their pages need no
        transfer). OutOfMemory (and nothing registered) when the pools cannot hold it now."""
        cache = self.prefix_cache
        if self.slots.available == 0 and not (cache and cache.evict(slots=1)):
            raise OutOfMemory("no free slot for a transferred request")
        blocks = cache.match(req.prompt_ids) if cache is not None else []
        shared = [p for b in blocks for p in b.pages]
        need = self._pages_for(len(req.prompt_ids) + 1) - len(shared)
        if self.pages.available < need and not (cache and cache.evict(pages=need)):
            if blocks:
                cache.release(blocks)
            raise OutOfMemory(
                f"need {need} free KV pages for a transferred request, {self.pages.available} free"
            )
        self.register(req)
        if cache is not None:
            cache.record_lookup(len(req.prompt_ids), blocks)
        req.mamba_slot = self.slots.alloc(1)[0]
        req.kv_pages = shared + self.pages.alloc(need)
        req.cached_blocks = blocks
        req.num_cached_tokens = len(blocks) * cache.track_interval if blocks else 0
        req.status = Status.TRANSFERRING

    def start_transferred(self, req: Request) -> None:
        """Its prompt's state is installed: it runs from here (its first token, the prefill
        side's, is appended next)."""
        req.num_computed = len(req.prompt_ids)
        req.status = Status.RUNNING
        req.draft_from_slot = self.spec is not None  # its drafts come from the kept state
        self.running.append(req)

    def extend_chain(self, req: Request, k: int, checkpoint_slot: int | None) -> bool:
        """Register block k of a transferred prompt whose checkpoint is in `checkpoint_slot`
        (see PrefixBlocks.extend_chain)."""
        return self.blocks.extend_chain(req, k, checkpoint_slot)

    def checkpoint_slot(self) -> int | None:
        return self.blocks.checkpoint_slot()

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self.release_held()
        if self.config.policy == "prefill-first" and self.waiting:
            # SGLang's default: while requests wait, a step runs prefills only (new ones and the
            # next chunks of running ones), so a new request's first step carries no decode rows;
            # the decodes run in the next step that admits nothing.
            batch = self._build(with_decodes=False, budget=self.config.max_prefill_tokens)
            if batch is not None:
                return batch
        return self._build(with_decodes=True, budget=self.config.max_num_batched_tokens)

    def update_from_output(
        self,
        sched: ScheduledBatch,
        sampled: Sampled,
        prompt_logprobs: dict[int, list[TokenLogprobs | None]],
        drafts: Drafts,
    ) -> list[RequestDelta]:
        """After the forward: the sampled tokens are appended (a request may finish: it ends
        after the bookkeeping below), the tokens fed are computed (a verify's up to its last
        accepted draft, its state rolled back there), the new blocks are cached, the prompt
        logprobs and the next drafts stored."""
        reqs = [self.requests[rid] for rid in sched.request_ids]
        nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
        appended = {s: self._append(reqs[s], tokens) for s, tokens in sampled.items()}
        for s, req in enumerate(reqs):
            if nd <= s < nd + nv:
                # the last token and the accepted drafts (fewer when a stop ended it early)
                kept = min(len(sampled[s].token_ids), len(appended[s].token_ids))
                self.spec.accept(req, sched.start_positions[s], sched.verify_slots[s - nd], kept)
                req.num_computed += kept
                self._trim_pages(req, req.num_computed + self.spec.config.draft_lookahead)
            else:
                req.num_computed += sched.seq_lens[s]
        if self.blocks is not None:
            self.blocks.commit(self.running)
        for s, logprobs in prompt_logprobs.items():
            reqs[s].prompt_logprobs.extend(logprobs)
        deltas = [self._delta(reqs[s], appended[s]) for s in sampled]
        for s in sampled:
            reqs[s].draft_from_slot = False
            if not reqs[s].finished:
                reqs[s].drafts = list(drafts.get(s, ()))
        return deltas

    def append_token(
        self, req: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestDelta:
        """One generated token (the first one of a handed-over prefill); ends the request on
        EOS, a stop token or its length."""
        return self._delta(req, self._append(req, SampledTokens((token,), (logprobs,))))

    def reserve_draft_pages(self, req: Request) -> bool:
        """Pages for the positions a handed-over request's first drafts are written at, before
        its first step (nothing is preempted for them: False when they cannot be had now)."""
        lookahead = self._lookahead(req, 1, self.spec.config.draft_lookahead)
        need = self._pages_for(req.num_computed + 1 + lookahead) - len(req.kv_pages)
        cache = self.prefix_cache
        if need > self.pages.available and not (cache and cache.evict(pages=need)):
            return False
        if need > 0:
            req.kv_pages.extend(self.pages.alloc(need))
        return True

    def set_drafts(self, req: Request, drafts: tuple[int, ...]) -> None:
        """Drafts proposed outside a step (a handed-over request's first ones)."""
        req.drafts = list(drafts)
        req.draft_from_slot = False

    def _append(self, req: Request, sampled: SampledTokens) -> Appended:
        """Append the step's tokens until one ends the request (engine/core/scheduler_tokens.py);
        the request is ended by `_delta`, after the step's bookkeeping."""
        appended = append_tokens(
            req, sampled, self.constraint, self.config.eos_token_ids, self.config.max_model_len
        )
        self.generation_tokens_total += len(appended.token_ids)
        return appended

    def _delta(self, req: Request, appended: Appended) -> RequestDelta:
        """The step's delta of `req`; ends it first when its tokens say so."""
        if appended.finish is not None:
            hook = self.finish_hooks.pop(req.request_id, None)
            if hook is not None:
                hook(req)  # before its pages and slot are freed
            self.finish(req, appended.finish, appended.stop_reason)
        return delta_of(req, appended)

    def _build(self, with_decodes: bool, budget: int) -> ScheduledBatch | None:
        cfg = self.config
        decodes: list[tuple[Request, int]] = []
        verifies: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        spec = self.spec if self.speculating() else None
        # pages for the positions the drafter writes past the step's own (an MTP chain)
        lookahead = spec.config.draft_lookahead if spec is not None else 0

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            decoding = req.num_remaining == 1
            if decoding and not with_decodes:
                continue
            drafts = spec.drafts_to_verify(req) if spec is not None and decoding else []
            if len(drafts) >= budget:
                drafts = []  # a verify row would not fit the step's budget: decode
            n = (
                1 + len(drafts)
                if decoding
                else min(req.num_remaining, cfg.chunked_prefill_size, budget)
            )
            ahead = self._lookahead(req, n, lookahead) if n == req.num_remaining or drafts else 0
            if not self._reserve_pages(req, req.num_computed + n + ahead, scheduled):
                continue  # req itself was preempted
            (verifies if drafts else decodes if decoding else prefills).append((req, n))
            scheduled.add(id(req))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < cfg.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req, budget):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(req.num_remaining, cfg.chunked_prefill_size, budget)
            ahead = self._lookahead(req, n, lookahead) if n == req.num_remaining else 0
            self._reserve_pages(req, req.num_computed + n + ahead, scheduled)
            (decodes if req.num_remaining == 1 else prefills).append((req, n))
            scheduled.add(id(req))
            budget -= n

        if not decodes and not verifies and not prefills:
            return None
        return self._batch(decodes, verifies, prefills)

    def _admit(self, req: Request, budget: int) -> bool:
        """Give `req` a working Mamba slot (fresh, or a copy of its deepest cached checkpoint)
        and the KV pages of its cached prefix; False if memory does not allow it now."""
        cache = self.prefix_cache
        if self.slots.available == 0 and not (cache and cache.evict(slots=1)):
            return False
        blocks = []
        if cache is not None and not req.wants_prompt_logprobs:
            blocks = cache.match(req.all_ids)
        cached = len(blocks) * cache.track_interval if blocks else 0
        n = min(req.num_tokens - cached, self.config.chunked_prefill_size, budget)
        need = self._pages_for(cached + n) - len(blocks) * (cache.pages_per_block if cache else 0)
        if self.pages.available < need and not (cache and cache.evict(pages=need)):
            if blocks:
                cache.release(blocks)
            return False
        if cache is not None and not req.wants_prompt_logprobs:
            cache.record_lookup(len(req.all_ids), blocks)
        req.mamba_slot = self.slots.alloc(1)[0]
        if blocks:
            self.slot_ops.copy(blocks[-1].checkpoint_slot, req.mamba_slot)
            req.cached_blocks = blocks
            req.kv_pages = [p for b in blocks for p in b.pages]
            req.num_computed = cached
            req.num_cached_tokens = max(req.num_cached_tokens, cached)
        else:
            self.slot_ops.reset(req.mamba_slot)
        return True

    def _batch(
        self,
        decodes: list[tuple[Request, int]],
        verifies: list[tuple[Request, int]],
        prefills: list[tuple[Request, int]],
    ) -> ScheduledBatch:
        rows = decodes + verifies + prefills
        nd, nv = len(decodes), len(verifies)
        input_ids: list[int] = []
        logits_seqs, prompt_logprob_seqs = [], []
        for s, (req, n) in enumerate(rows):
            if nd <= s < nd + nv:  # the last token, then the drafts
                input_ids.extend([req.all_ids[req.num_computed], *req.drafts])
                logits_seqs.append(s)
                continue
            input_ids.extend(req.all_ids[req.num_computed : req.num_computed + n])
            if req.num_computed + n == req.num_tokens:
                logits_seqs.append(s)
            if req.wants_prompt_logprobs and req.num_computed < len(req.prompt_ids):
                prompt_logprob_seqs.append(s)
        if not prefills:
            mode = "verify" if verifies else "decode"
        else:
            mode = "extend" if not decodes and not verifies else "mixed"
        points = (
            self.blocks.track_points(rows, skip=range(nd, nd + nv))
            if self.blocks is not None
            else []
        )
        return ScheduledBatch(
            mode=mode,
            request_ids=tuple(req.request_id for req, _ in rows),
            num_decode_seqs=nd,
            num_verify_seqs=nv,
            input_ids=tuple(input_ids),
            seq_lens=tuple(n for _, n in rows),
            start_positions=tuple(req.num_computed for req, _ in rows),
            kv_pages=tuple(tuple(req.kv_pages) for req, _ in rows),
            mamba_slots=tuple(req.mamba_slot for req, _ in rows),
            verify_slots=tuple(Speculation.verify_slots(req) for req, _ in verifies),
            logits_seqs=tuple(logits_seqs),
            prompt_logprob_seqs=tuple(prompt_logprob_seqs),
            has_mamba_track_mask=bool(points),
            track_points=tuple(points),
        )

    # -- memory -----------------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        page_size = self.config.page_size
        return 0 if page_size is None else -(-num_tokens // page_size)

    def _reserve_pages(self, req: Request, num_tokens: int, scheduled: set[int]) -> bool:
        """Make req hold pages for `num_tokens` tokens, preempting later requests if needed.
        Returns False if req itself had to be preempted."""
        need = self._pages_for(num_tokens) - len(req.kv_pages)
        if need > self.pages.available and self.prefix_cache is not None:
            self.prefix_cache.evict(pages=need)
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

    def _lookahead(self, req: Request, n: int, lookahead: int) -> int:
        """The drafter's positions past a step that feeds `n` tokens, within the context (the
        drafter drafts nothing that would pass it)."""
        return max(0, min(lookahead, self.config.max_model_len - req.num_computed - n))

    def _trim_pages(self, req: Request, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (a verify's rejected drafts);
        a cached block's pages are never among them (they hold computed tokens)."""
        keep = self._pages_for(num_tokens)
        if len(req.kv_pages) > keep:
            self.pages.free(req.kv_pages[keep:])
            del req.kv_pages[keep:]

    def preempt(self, req: Request) -> None:
        """Preemption by recompute: drop all cached state; resume from scratch later."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        if not req.output_ids:
            req.prompt_logprobs = []  # recomputed with the prompt (wants_prompt_logprobs)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        """Give back what `req` holds, or park it while its hold reads it. The hold stays on the
        request: a preempted one that runs again writes new pages that its hold reads too (a
        disaggregated prefill streams pages while it computes), and they must outlive its end."""
        if self.spec is not None:
            self.spec.release(req)  # scratch slots hold nothing a hold reads
        pages, slot, blocks = req.kv_pages, req.mamba_slot, req.cached_blocks
        req.kv_pages, req.mamba_slot, req.cached_blocks = [], 0, []
        if req.hold is not None and not req.hold.done:
            self.held.append((req.hold, pages, slot, blocks))
        else:
            self._free(pages, slot, blocks)

    def _free(self, pages: list[int], slot: int, blocks: list) -> None:
        shared = 0
        if blocks:
            self.prefix_cache.release(blocks)
            shared = len(blocks) * self.prefix_cache.pages_per_block
        if pages:
            self.pages.free(pages[shared:])
        if slot:
            self.slots.free([slot])
