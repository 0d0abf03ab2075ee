"""The handover connector: the one interface a disaggregation worker (prefill or decode) uses on
its engine, as vLLM's KV connector splits it:

    scheduler half   which pages and slot a transferred request gets (preallocate), what the
                     decode side caches already (skip), when its state is complete and the
                     request starts (install), which blocks of its prompt join the prefix
                     cache, what a finished prefill keeps held while its state is sent
    worker half      snapshot and install of the state itself (engine/handover/io.py on this
                     rank, engine/handover/shards.py on every rank at TP > 1)

Everything is derived from the model's state spec: tensors travel by pool name. The engine
loop and scheduler know nothing of the wire (that is disagg/), and the engine names no
disaggregation module: the per-rank wire connector is handed in by whoever builds the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.fingerprint import config_fingerprint, weights_fingerprint
from baton.engine.core.outputs import RequestDelta
from baton.engine.core.request import Hold, Request, Status
from baton.engine.core.sampler import Sampler
from baton.engine.core.scheduler import Scheduler
from baton.engine.handover.io import StateIO
from baton.engine.handover.ranks import ShardHandover
from baton.engine.handover.state import HandoverLayout, Preallocation, RequestState, StatePlace
from baton.engine.models.registry import family_named
from baton.engine.structured_output.grammars import Grammars


class Handover:
    def __init__(
        self,
        *,
        model_dir: Path,
        config,
        dtype: torch.dtype,
        cache: StateCache,
        scheduler: Scheduler,
        sampler: Sampler,
        grammars: Grammars,
        new_request: Callable[..., Request],
        shards: ShardHandover,
        online_quantization: bool = False,
    ):
        """online_quantization: the weights were quantized at load (--quantization fp8 on an
        unquantized checkpoint): not the checkpoint's, so part of the weights fingerprint."""
        self.model_dir = model_dir
        self.config = config
        self.dtype = dtype
        self.cache = cache
        self.io = StateIO(cache)
        self.scheduler = scheduler
        self.sampler = sampler
        self.grammars = grammars
        self.new_request = new_request
        self.shards = shards
        self.online_quantization = online_quantization
        self._layout: HandoverLayout | None = None

    def layout(self) -> HandoverLayout:
        if self._layout is None:
            self._layout = HandoverLayout.of(
                self.cache.spec,
                model_fingerprint=config_fingerprint(self.config),
                weights_fingerprint=weights_fingerprint(
                    self.model_dir,
                    family_named(self.config.architecture).checkpoint_name,
                    "online fp8" if self.online_quantization else "",
                ),
                dtype=self.dtype,
                page_size=self.cache.page_size,
                tp_size=self.shards.tp_size,
                tp_rank=0,
            )
        return self._layout

    @property
    def track_interval(self) -> int:
        cache = self.scheduler.prefix_cache
        return cache.track_interval if cache is not None else 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def hold_request(self, request_id: str, hold: Hold) -> None:
        self.scheduler.hold(request_id, hold)

    def on_finish(self, request_id: str, hook: Callable[[Request], None] | None) -> None:
        """Call `hook` with the finished request before its pages and slot are freed (None:
        forget the hook)."""
        if hook is None:
            self.scheduler.finish_hooks.pop(request_id, None)
        else:
            self.scheduler.finish_hooks[request_id] = hook

    def has_held(self) -> bool:
        """Whether pages or slots of ended requests wait for their holds (sends in flight)."""
        return bool(self.scheduler.memory.held)

    def release_held(self) -> None:
        self.scheduler.release_held()

    # -- decode side ------------------------------------------------------------------------

    def preallocate(self, request_id: str, prompt_token_ids: list[int], params) -> Preallocation:
        """Reserve pages for the prompt and a slot for a request whose prefill runs on another
        engine. Raises ValueError for invalid requests, OutOfMemory when full (nothing kept)."""
        req = self.new_request(request_id, prompt_token_ids, params)
        self.scheduler.reserve_for_transfer(req)
        self.grammars.add(req)  # structured outputs: compiled while the prefill runs elsewhere
        return Preallocation(
            pages=tuple(req.kv_pages),
            slot=req.mamba_slot,
            num_prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.num_cached_tokens,
        )

    def _transferring(self, request_id: str) -> Request | None:
        req = self.scheduler.get(request_id)
        return req if req is not None and req.status is Status.TRANSFERRING else None

    def install(self, request_id: str, state: RequestState) -> RequestDelta | None:
        """Write a transferred prefill into the preallocated pages and slot, register the prompt's
        checkpointed blocks in this engine's prefix cache, append the first token and start
        decoding. Returns the first token's delta (None if the request is gone)."""
        req = self._transferring(request_id)
        if req is None:
            return None
        if state.num_prompt_tokens != len(req.prompt_ids):
            raise ValueError(
                f"request {request_id}: transferred state is for another prompt length"
            )
        self.install_pages(request_id, state.first_page, state.pages)
        self.io.write_slot_state(req.mamba_slot, state.slots)
        if not self.shards.register_checkpoints(req, state.first_block):
            self._register_transferred_blocks(req, state)
        # Structured outputs: the grammar's state is replayed, not carried: this engine compiled
        # the same grammar, and the scheduler feeds it the first token (held until compiled).
        self.grammars.hold(req, self.scheduler.start_transferred)
        self.sampler.skip_seeded_draws(req, 1, self.config.vocab_size)  # the first token
        return self.scheduler.append_token(req, state.first_token, state.first_logprobs)

    def install_pages(
        self,
        request_id: str,
        first_page: int,
        pages: Mapping[str, Sequence[torch.Tensor] | torch.Tensor],
    ) -> None:
        """Write pages that arrive ahead of the final state (streamed per prefill chunk):
        pages[name][layer] is (n, page, *shape) for every paged tensor."""
        req = self._transferring(request_id)
        if req is None:
            return
        if set(pages) != set(self.cache.paged):
            raise ValueError(
                f"request {request_id}: pages of {sorted(pages)}, this model keeps"
                f" {sorted(self.cache.paged)}"
            )
        counts = {t.shape[0] for per_layer in pages.values() for t in per_layer}
        if len(counts) > 1:
            raise ValueError(
                f"request {request_id}: frames of one chunk hold different page counts"
            )
        n = counts.pop() if counts else 0
        if n and first_page + n > len(req.kv_pages):
            raise ValueError(f"request {request_id}: streamed pages do not fit its preallocation")
        cached_pages = self.cache.entries(req.num_cached_tokens // self.cache.page_size)
        if n and first_page < cached_pages:  # shared with other requests: never written here
            raise ValueError(
                f"request {request_id}: pages from {first_page} sent, but the first"
                f" {cached_pages} are this engine's cached prefix"
            )
        self.io.write_pages(req.kv_pages[first_page : first_page + n], pages)

    def install_unit(self, request_id: str, unit, frames: Mapping[str, torch.Tensor]) -> bool:
        """Write one layer's slot state pushed ahead of the final state; False if the request
        is gone."""
        req = self._transferring(request_id)
        if req is None:
            return False
        self.io.write_unit(req.mamba_slot, unit, frames)
        return True

    def reserve_place(
        self, request_id: str, first_page: int, first_block: int, num_blocks: int
    ) -> StatePlace:
        """Where a transferred state is to be written straight into the pools (a transfer
        engine reading from the prefill engine's): the preallocated pages from `first_page`,
        which must be the first after this engine's cached prefix (those are shared with other
        requests), the request's slot, and checkpoint slots for the prompt's blocks
        `first_block`.. (reserved here until `install` registers them, or
        `shards.release_checkpoints` gives them back). ValueError naming what does not fit."""
        req = self._transferring(request_id)
        if req is None:
            raise ValueError(f"request {request_id} is gone")
        ps = self.cache.page_size
        num_pages = self.cache.entries(-(-len(req.prompt_ids) // ps)) if self.cache.paged else 0
        cached_pages = self.cache.entries(req.num_cached_tokens // ps) if self.cache.paged else 0
        if not cached_pages == first_page <= num_pages:
            raise ValueError(
                f"the prefill worker sends pages from {first_page}, expected from"
                f" {cached_pages} (the first {cached_pages} of {num_pages} are cached here)"
            )
        slots = self.shards.reserve_checkpoints(req, first_block, num_blocks)
        return StatePlace(
            pages=tuple(req.kv_pages[first_page:num_pages]),
            slot=req.mamba_slot,
            checkpoint_slots=slots,
        )

    def direct_state(self, header: Mapping[str, object], num_blocks: int) -> RequestState:
        """The state to `install` once its tensors were written straight into a reserved place:
        `header`'s first token (RequestState's other fields), no pages, no slot layers, and
        `num_blocks` checkpoints of no layers (the blocks `install` registers)."""
        return RequestState(
            **header,
            pages=self.io.gather_pages([]),
            slots=self.io.no_slot_state(),
            checkpoints=self.io.no_checkpoints(num_blocks),
        )

    def clear_unkept(self, place: StatePlace) -> None:
        """After a state was written straight into `place`: its checkpoint slots' tensors that
        checkpoints do not keep start from zero, as `install` leaves them."""
        for slot in place.checkpoint_slots:
            if slot:
                self.io.clear_unkept(slot)

    def _register_transferred_blocks(self, req: Request, state: RequestState) -> None:
        """The prompt's block checkpoints let later requests (the next turn of a chat) reuse
        this prompt on the decode side too."""
        cache = self.scheduler.prefix_cache
        if cache is None:
            return
        for i in range(state.num_blocks):
            k = state.first_block + i
            if k != len(req.cached_blocks):
                return
            slot = None
            key = cache.chain_keys(req.all_ids, k + 1, adapter=req.params.lora_name)[-1]
            if cache.lookup(key) is None:
                slot = self.scheduler.checkpoint_slot()
                if slot is None:
                    return
                self.io.write_checkpoint(slot, state.checkpoints, i)
            if not self.scheduler.extend_chain(req, k, slot):
                return

    # -- prefill side -----------------------------------------------------------------------

    def pool_tensors(self) -> dict[str, torch.Tensor]:
        """Every pool tensor by name (engine/cache/pools.py's layout) but those another pool's
        memory holds, for a transfer engine to register once at start: what it then reads or
        writes there is a request's StatePlace."""
        return self.cache.moved_pools()

    def place_of(self, req: Request) -> StatePlace:
        """Where a finished prefill's state sits (its prompt's pages, its slot, its blocks'
        checkpoints), read in place while the request's hold keeps them."""
        return StatePlace(
            pages=tuple(self.prompt_pages(req)),
            slot=req.mamba_slot,
            checkpoint_slots=tuple(b.checkpoint_slot for b in req.cached_blocks),
        )

    def prompt_pages(self, req: Request) -> list[int]:
        return req.kv_pages[: self.cache.entries(-(-len(req.prompt_ids) // self.cache.page_size))]

    def export_pages(
        self, request_id: str, first_page: int, max_pages: int | None = None
    ) -> tuple[int, dict[str, list[torch.Tensor]]] | None:
        """The pages a prefill has completed from `first_page` on, at most `max_pages`: (end page,
        per paged tensor one (n, page, *shape) tensor per layer). Once the prompt is fully
        computed its last, partial page counts as complete. None if nothing new.

        On a CPU pool a run of consecutive pool pages comes back as views of the pool itself (no
        copy; the run ends early at a gap), so the caller must keep the pages in place until it
        has sent them (Request.hold). Elsewhere the pages are gathered into copies."""
        req = self.scheduler.get(request_id)
        if req is None or not self.cache.paged:
            return None
        ps, prompt = self.cache.page_size, len(req.prompt_ids)
        done = min(req.num_computed, prompt)
        end = self.cache.entries(-(-prompt // ps) if done == prompt else done // ps)
        if max_pages is not None:
            end = min(end, first_page + max_pages)
        if end <= first_page:
            return None
        pages = req.kv_pages[first_page:end]
        if self.cache.device.type != "cpu":
            gathered = self.io.gather_pages(pages)
            return end, {name: list(t.unbind(0)) for name, t in gathered.items()}
        n, views = self.io.page_run(pages)
        return first_page + n, views

    def export_unit(self, req: Request, unit) -> list[tuple[str, torch.Tensor]]:
        """One layer's final slot state: views of the pool (the caller keeps the slot until it
        has sent them)."""
        return self.io.unit_views(req.mamba_slot, unit)

    def export_state(
        self, req: Request, first_page: int = 0, with_slots: bool = True
    ) -> RequestState:
        """Snapshot (copy) a request's pages from `first_page` on (the ones before were streamed
        already) and its slot state after its prefill (unless it was pushed already:
        `with_slots=False` leaves the slot tensors with no layers), with the checkpoints of its
        prefix-cache blocks."""
        num_pages = self.cache.entries(-(-len(req.prompt_ids) // self.cache.page_size))
        first_page = min(first_page, num_pages)
        return RequestState(
            num_prompt_tokens=len(req.prompt_ids),
            first_token=req.output_ids[0],
            first_logprobs=req.logprobs[0] if req.logprobs else None,
            first_page=first_page,
            first_block=0,
            pages=self.io.gather_pages(req.kv_pages[first_page:num_pages]),
            slots=self.io.copy_slot_state(req.mamba_slot)
            if with_slots
            else self.io.no_slot_state(),
            checkpoints=self.io.gather_checkpoints([b.checkpoint_slot for b in req.cached_blocks]),
        )

    def first_token_state(
        self, source: Request | RequestState, first_page: int = 0
    ) -> RequestState:
        """The part of a handed-over state that goes through rank 0 when the tensors go rank to
        rank: the first token (of a finished request, or of a whole snapshot) with no pages and
        no slot layers, from page `first_page` on. Its checkpoints keep their block count, with
        no layers: they tell the decode side which blocks the ranks send."""
        if isinstance(source, RequestState):
            num_prompt_tokens = source.num_prompt_tokens
            first_token, first_logprobs = source.first_token, source.first_logprobs
            first_block, num_blocks = source.first_block, source.num_blocks
        else:
            num_prompt_tokens = len(source.prompt_ids)
            first_token = source.output_ids[0]
            first_logprobs = source.logprobs[0] if source.logprobs else None
            first_block, num_blocks = 0, len(source.cached_blocks)
        return RequestState(
            num_prompt_tokens=num_prompt_tokens,
            first_token=first_token,
            first_logprobs=first_logprobs,
            first_page=first_page,
            first_block=first_block,
            pages=self.io.gather_pages([]),
            slots=self.io.no_slot_state(),
            checkpoints=self.io.no_checkpoints(num_blocks),
        )
