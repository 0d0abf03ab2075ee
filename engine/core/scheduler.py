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
Under a sliding window (the paged state of the request's last page table reads only the last
`page_window` tokens: every paged kind's, or the windowed kinds' beside full attention) a
running request gives back that table's pages wholly behind the window before its step (a
decode, or its next prefill chunk). When the KV pool runs
dry, the most recently admitted request not yet scheduled this step is
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
from baton.engine.core.scheduler_batch import scheduled_batch
from baton.engine.core.scheduler_blocks import PrefixBlocks
from baton.engine.core.scheduler_memory import RequestMemory, SlotOps
from baton.engine.core.scheduler_spec import SpecSchedule, Speculation
from baton.engine.core.scheduler_tokens import Appended, OutputConstraint, append_tokens, delta_of
from baton.engine.executor.forward_metadata import ScheduledBatch


class AdapterSlots(Protocol):
    def acquire(self, name: str) -> int | None: ...
    def release(self, slot: int) -> None: ...


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
    # Page tables a request holds (ModelStateSpec.page_tables), interleaved in its page list
    page_tables: int
    # Tokens the paged state of the last page table still reads back (ModelStateSpec.page_window):
    # a decoding request's pages of that table wholly behind it are released; None: pages are
    # kept while it runs.
    page_window: int | None
    policy: SchedulePolicy
    max_prefill_tokens: int  # token budget of a prefill-first step (<= max_num_batched_tokens)
    max_model_len: int  # a request that reaches it ends with "length"
    eos_token_ids: tuple[int, ...]


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
        adapters: AdapterSlots | None = None,
    ):
        """adapters: the LoRA slot table (engine/lora/slots.py); a request with an adapter is
        admitted only while its adapter holds (or can take) a slot."""
        self.config = config
        self.adapters = adapters
        self.constraint = constraint
        self.pages = pages
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.memory = RequestMemory(
            config.page_size, config.page_tables, pages, slots, slot_ops, prefix_cache
        )
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
        self._check_unused(req.request_id)
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
        self.memory.release_held()

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    # -- the handover's scheduler half ----------------------------------------------------------

    def reserve_for_transfer(self, req: Request) -> None:
        """Decode side of a disaggregated pair: a slot and pages for the prompt plus the first
        generated token, held while the prefill engine computes and sends them. Blocks of the
        prompt this engine already caches are shared, not reserved (their pages need no
        transfer). OutOfMemory (and nothing registered) when the pools cannot hold it now."""
        self._check_unused(req.request_id)
        if not self._take_adapter(req):
            raise OutOfMemory(f"no adapter slot free for {req.params.lora_name!r}")
        try:
            self.memory.reserve_transfer(req)
        except BaseException:
            self._drop_adapter(req)
            raise
        self.register(req)
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
                self.memory.trim(req, req.num_computed + self.spec.config.draft_lookahead)
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
        return self.memory.grow(req, req.num_computed + 1 + lookahead) == 0

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
            # pages behind the window of its next query go back, between prefill chunks too
            self.memory.release_window(req, cfg.page_window)
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
            if not self._take_adapter(req):
                break  # every adapter slot is pinned by other adapters' running requests
            if not self.memory.admit(req, cfg.chunked_prefill_size, budget):
                self._drop_adapter(req)
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
        return scheduled_batch(decodes, verifies, prefills, self.blocks, cfg.page_tables)

    # -- memory -----------------------------------------------------------------------------

    def _take_adapter(self, req: Request) -> bool:
        """Pin `req`'s adapter in a slot (req.lora_slot); False when no slot can take it."""
        name = req.params.lora_name
        if name is None or req.lora_slot >= 0:
            return True
        if self.adapters is None:
            raise ValueError(f"request {req.request_id}: adapter {name!r} but LoRA is not enabled")
        slot = self.adapters.acquire(name)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _drop_adapter(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.adapters.release(req.lora_slot)
            req.lora_slot = -1

    def _reserve_pages(self, req: Request, num_tokens: int, scheduled: set[int]) -> bool:
        """Make req hold pages for `num_tokens` tokens, preempting later requests if needed.
        Returns False if req itself had to be preempted."""
        missing = self.memory.grow(req, num_tokens)  # idle cached blocks are evicted first
        while missing:
            victim = next(
                (r for r in reversed(self.running) if r is not req and id(r) not in scheduled), None
            )
            if victim is None:
                self.preempt(req)
                return False
            self.preempt(victim)
            missing = self.memory.grow(req, num_tokens, evict=False)
        return True

    def _lookahead(self, req: Request, n: int, lookahead: int) -> int:
        """The drafter's positions past a step that feeds `n` tokens, within the context (the
        drafter drafts nothing that would pass it)."""
        return max(0, min(lookahead, self.config.max_model_len - req.num_computed - n))

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
        """Give back what `req` holds (engine/core/scheduler_memory.py), its scratch slots too."""
        if self.spec is not None:
            self.spec.release(req)  # scratch slots hold nothing a hold reads
        self._drop_adapter(req)
        self.memory.release(req)
