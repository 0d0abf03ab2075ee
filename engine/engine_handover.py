"""Engine methods for disaggregation: the decode side preallocates and installs a transferred
prefill, the prefill side exports its pages and state. Mixed into `Engine`; the engine loop and
scheduler know nothing of the wire (that is disagg/)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from engine.cache.memory import OutOfMemory
from engine.cache.pools import StateCache
from engine.cache.prefix_cache import PrefixCache
from engine.checkpoint.fingerprint import config_fingerprint, weights_fingerprint
from engine.config import ModelConfig
from engine.core.outputs import RequestDelta, TokenLogprobs
from engine.core.request import Request, Status
from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.handover.state import HandoverLayout, Preallocation, RequestState


class Hold(Protocol):
    """Keeps an ended request's pages and slot in place while `done` is False (sends in
    flight that still read them)."""

    @property
    def done(self) -> bool: ...


def _run_length(pages: list[int]) -> int:
    """How many of `pages` from the first on are consecutive pool pages (one slice of a pool)."""
    run = 1
    while run < len(pages) and pages[run] == pages[0] + run:
        run += 1
    return run


class HandoverMixin:
    """The operations a disaggregation worker performs on its engine, as typed methods (a
    worker never touches the engine's attributes). Mixed into Engine, which provides what is
    declared here."""

    model_config: ModelConfig
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    cache: StateCache
    scheduler: Scheduler
    sampler: Sampler
    prefix_cache: PrefixCache | None
    requests: dict[str, Request]
    finish_hooks: dict[str, Callable[[Request], None]]
    prompt_tokens_total: int
    register_shard_checkpoints: Callable[[Request, int], bool]  # ShardHandoverMixin's

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        raise NotImplementedError  # Engine's

    def _append_token(
        self, req: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestDelta:
        raise NotImplementedError  # Engine's

    # -- both sides ---------------------------------------------------------------------------

    def handover_layout(self) -> HandoverLayout:
        cache, config = self.cache, self.model_config
        k = cache.k[0] if cache.k else None
        page_shape = (cache.page_size, *k.shape[1:]) if k is not None else (cache.page_size, 0, 0)
        return HandoverLayout(
            model_fingerprint=config_fingerprint(config),
            weights_fingerprint=weights_fingerprint(self.model_dir),
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=cache.page_size,
            attention_layers=len(cache.k),
            kv_page_shape=page_shape,
            kv_page_bytes=sum(2 * t[: cache.page_size].numel() * t.element_size() for t in cache.k),
            mamba_layers=cache.conv.shape[0],
            conv_shape=tuple(cache.conv.shape[2:]),
            ssm_shape=tuple(cache.ssm.shape[2:]),
            ssm_dtype=str(cache.ssm.dtype).removeprefix("torch."),
            mamba_layer_bytes=cache.conv[:, 0].nbytes // max(1, cache.conv.shape[0])
            + cache.ssm[:, 0].nbytes // max(1, cache.ssm.shape[0]),
            model_kv_page_shape=(cache.page_size, config.num_key_value_heads, config.head_dim)
            if cache.k
            else page_shape,
            model_conv_shape=(config.conv_dim, config.conv_kernel - 1),
            model_ssm_shape=(config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size),
            tp_size=self.ranks.size if self.ranks is not None else 1,
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def hold_request(self, request_id: str, hold: Hold) -> None:
        """Keep the request's pages and slot in place after it ends, until `hold.done`."""
        self.requests[request_id].hold = hold

    def on_finish(self, request_id: str, hook: Callable[[Request], None] | None) -> None:
        """Call `hook` with the finished request before its pages and slot are freed (None:
        forget the hook)."""
        if hook is None:
            self.finish_hooks.pop(request_id, None)
        else:
            self.finish_hooks[request_id] = hook

    # -- disaggregation: decode side ----------------------------------------------------------

    @property
    def track_interval(self) -> int:
        return self.prefix_cache.track_interval if self.prefix_cache is not None else 0

    def preallocate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Preallocation:
        """Reserve KV pages for the prompt and a Mamba slot for a request whose prefill runs on
        another engine. Raises ValueError for invalid requests, OutOfMemory when full."""
        req = self._new_request(request_id, prompt_token_ids, params)
        try:
            self.scheduler.reserve_for_transfer(req)
        except OutOfMemory:  # as if never added: the caller may try again later
            self.requests.pop(request_id)
            self.prompt_tokens_total -= len(req.prompt_ids)
            raise
        return Preallocation(
            pages=tuple(req.kv_pages),
            mamba_slot=req.mamba_slot,
            num_prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.num_cached_tokens,
        )

    def install(self, request_id: str, state: RequestState) -> RequestDelta | None:
        """Write a transferred prefill into the preallocated pages and slot, register the prompt's
        checkpointed blocks in this engine's prefix cache, append the first token and start
        decoding. Returns the first token's delta (None if the request is gone)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.TRANSFERRING:
            return None
        if state.num_prompt_tokens != len(req.prompt_ids):
            raise ValueError(
                f"request {request_id}: transferred state is for another prompt length"
            )
        self.install_pages(request_id, state.first_page, state.k_pages, state.v_pages)
        if state.conv.shape[0]:  # else every layer came ahead in install_mamba
            self.cache.conv[:, req.mamba_slot] = state.conv.to(self.device, self.cache.conv.dtype)
            self.cache.ssm[:, req.mamba_slot] = state.ssm.to(self.device, self.cache.ssm.dtype)
        req.num_computed = len(req.prompt_ids)
        self._register_transferred_blocks(req, state)
        self.scheduler.start_transferred(req)
        self.sampler.skip_seeded_draws(req, 1, self.model_config.vocab_size)  # the first token
        return self._append_token(req, state.first_token, state.first_logprobs)

    def install_pages(
        self,
        request_id: str,
        first_page: int,
        k_pages: Sequence[torch.Tensor],
        v_pages: Sequence[torch.Tensor],
    ) -> None:
        """Write K/V pages that arrive ahead of the final state (streamed per prefill chunk):
        k_pages[layer] and v_pages[layer] are (n, page, kv_heads, head_dim) for each attention
        layer (a list, or one stacked tensor)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.TRANSFERRING:
            return
        if len(k_pages) != len(self.cache.k) or len(v_pages) != len(self.cache.v):
            raise ValueError(
                f"request {request_id}: pages for {len(k_pages)} attention layers, "
                f"this model has {len(self.cache.k)}"
            )
        n = k_pages[0].shape[0] if self.cache.k else 0
        if first_page + n > len(req.kv_pages):
            raise ValueError(f"request {request_id}: streamed pages do not fit its preallocation")
        cached_pages = req.num_cached_tokens // self.cache.page_size
        if n and first_page < cached_pages:  # shared with other requests: never written here
            raise ValueError(
                f"request {request_id}: pages from {first_page} sent, but the first"
                f" {cached_pages} are this engine's cached prefix"
            )
        if not n:
            return
        ps = self.cache.page_size
        pages = req.kv_pages[first_page : first_page + n]
        if _run_length(pages) == n:  # one run of pool pages: plain slice copies
            rows = slice(pages[0] * ps, (pages[-1] + 1) * ps)
            for pool, src in zip((*self.cache.k, *self.cache.v), (*k_pages, *v_pages)):
                pool[rows].view(n, ps, *pool.shape[1:]).copy_(src)
            return
        index = torch.tensor(pages, device=self.device)
        for pool, src in zip((*self.cache.k, *self.cache.v), (*k_pages, *v_pages)):
            pool.view(-1, ps, *pool.shape[1:])[index] = src.to(self.device, pool.dtype)

    def _register_transferred_blocks(self, req: Request, state: RequestState) -> None:
        """The prompt's block checkpoints let later requests (the next turn of a chat) reuse
        this prompt on the decode side too."""
        if self.register_shard_checkpoints(req, state.first_block) or self.prefix_cache is None:
            return  # (a sharded install: the ranks wrote the checkpoints into their slots)
        for i in range(state.checkpoint_conv.shape[0]):
            k = state.first_block + i
            if k != len(req.cached_blocks):
                return
            slot = None
            key = self.prefix_cache.chain_keys(req.all_ids, k + 1)[-1]
            if self.prefix_cache.lookup(key) is None:
                slot = self.scheduler.checkpoint_slot()
                if slot is None:
                    return
                self.cache.conv[:, slot] = state.checkpoint_conv[i].to(
                    self.device, self.cache.conv.dtype
                )
                self.cache.ssm[:, slot] = state.checkpoint_ssm[i].to(
                    self.device, self.cache.ssm.dtype
                )
            if not self.scheduler.extend_chain(req, k, slot):
                return

    # -- disaggregation: prefill side ---------------------------------------------------------

    def has_held(self) -> bool:
        """Whether pages or slots of ended requests wait for their holds (sends in flight)."""
        return bool(self.scheduler.held)

    def release_held(self) -> None:
        """Give back the held pages and slots whose holds are done (each step does it too; this
        is for a worker that has no request to step)."""
        self.scheduler.release_held()

    def _gather_pages(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K/V `pages` of every attention layer, (layers, n, page, kv_heads, head_dim),
        gathered straight into one tensor each (the wire frames)."""
        if not self.cache.k:  # no attention layers: (0 layers, n pages)
            return torch.empty(0, len(pages)), torch.empty(0, len(pages))
        ps = self.cache.page_size
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        out = []
        for pool in (self.cache.k, self.cache.v):
            first = pool[0]
            dst = torch.empty(
                len(pool), len(pages), ps, *first.shape[1:], dtype=first.dtype, device=self.device
            )
            for layer, src in enumerate(pool if pages else ()):
                torch.index_select(src.view(-1, ps, *src.shape[1:]), 0, index, out=dst[layer])
            out.append(dst)
        return out[0], out[1]

    def export_pages(
        self, request_id: str, first_page: int, max_pages: int | None = None
    ) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
        """The K/V pages a prefill has completed from `first_page` on, at most `max_pages`:
        (end page, k per attention layer, v per attention layer), each (n, page, kv_heads,
        head_dim). Once the prompt is fully computed its last, partial page counts as complete.
        None if nothing new.

        On a CPU pool a run of consecutive pool pages comes back as views of the pool itself (no
        copy; the run ends early at a gap), so the caller must keep the pages in place until it
        has sent them (Request.hold). Elsewhere the pages are gathered into copies."""
        req = self.requests.get(request_id)
        if req is None or not self.cache.k:
            return None
        ps, prompt = self.cache.page_size, len(req.prompt_ids)
        done = min(req.num_computed, prompt)
        end = -(-prompt // ps) if done == prompt else done // ps
        if max_pages is not None:
            end = min(end, first_page + max_pages)
        if end <= first_page:
            return None
        pages = req.kv_pages[first_page:end]
        if self.device.type != "cpu":
            k, v = self._gather_pages(pages)
            return end, list(k.unbind(0)), list(v.unbind(0))
        run = _run_length(pages)
        rows = slice(pages[0] * ps, (pages[0] + run) * ps)
        k = [pool[rows].view(run, ps, *pool.shape[1:]) for pool in self.cache.k]
        v = [pool[rows].view(run, ps, *pool.shape[1:]) for pool in self.cache.v]
        return first_page + run, k, v

    def export_mamba(
        self, req: Request, first_layer: int, end_layer: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The request's conv and SSM state for Mamba layers [first_layer, end_layer), one tensor
        per layer: views of the pool (the caller keeps the slot until it has sent them)."""
        layers, slot = slice(first_layer, end_layer), req.mamba_slot
        return list(self.cache.conv[layers, slot].unbind(0)), list(
            self.cache.ssm[layers, slot].unbind(0)
        )

    def install_mamba(
        self,
        request_id: str,
        first_layer: int,
        conv: Sequence[torch.Tensor],
        ssm: Sequence[torch.Tensor],
    ) -> bool:
        """Write Mamba layers pushed ahead of the final state (one tensor per layer, or stacked);
        False if the request is gone."""
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.TRANSFERRING:
            return False
        end = first_layer + len(conv)
        if end > self.cache.conv.shape[0] or len(ssm) != len(conv):
            raise ValueError(f"request {request_id}: Mamba layers {first_layer}..{end} do not fit")
        for i in range(len(conv)):
            self.cache.conv[first_layer + i, req.mamba_slot].copy_(conv[i])
            self.cache.ssm[first_layer + i, req.mamba_slot].copy_(ssm[i])
        return True

    def export_state(
        self, req: Request, first_page: int = 0, with_mamba: bool = True
    ) -> RequestState:
        """Snapshot (copy) a request's K/V pages from `first_page` on (the ones before were
        streamed already) and its Mamba state after its prefill (unless it was pushed already:
        `with_mamba=False` leaves conv/ssm with no layers), with the checkpoints of its
        prefix-cache blocks."""
        num_pages = -(-len(req.prompt_ids) // self.cache.page_size)
        first_page = min(first_page, num_pages)
        k_pages, v_pages = self._gather_pages(req.kv_pages[first_page:num_pages])
        # The blocks' checkpoint slots (a list: indexing copies), or an empty slice when none.
        slots = [b.checkpoint_slot for b in req.cached_blocks] or slice(0)
        return RequestState(
            num_prompt_tokens=len(req.prompt_ids),
            first_token=req.output_ids[0],
            first_logprobs=req.logprobs[0] if req.logprobs else None,
            first_page=first_page,
            first_block=0,
            checkpoint_conv=self.cache.conv[:, slots].transpose(0, 1).contiguous(),
            checkpoint_ssm=self.cache.ssm[:, slots].transpose(0, 1).contiguous(),
            k_pages=k_pages,
            v_pages=v_pages,
            conv=self.cache.conv[:, req.mamba_slot].clone()
            if with_mamba
            else self.cache.conv[:0, 0],
            ssm=self.cache.ssm[:, req.mamba_slot].clone() if with_mamba else self.cache.ssm[:0, 0],
        )
