"""A request as the scheduler owns it: mutable, host-only."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from baton.engine.cache.prefix_cache import CachedBlock
from baton.engine.core.outputs import FinishReason, TokenLogprobs
from baton.engine.core.sampling_params import SamplingParams


class Hold(Protocol):
    @property
    def done(self) -> bool: ...


class Status(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"  # decode side: pages reserved, prefill state not yet installed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V and Mamba state are in the cache
    kv_pages: list[int] = field(default_factory=list)
    mamba_slot: int = 0  # 0 = the dummy slot, i.e. none held
    # the adapter slot held while running (engine/lora/slots.py); -1: none (no adapter, or
    # not admitted yet). Its adapter is params.lora_name.
    lora_slot: int = -1
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    # Prefix-cache blocks this request holds (locked); their pages are kv_pages[: k * pages_per_block].
    cached_blocks: list[CachedBlock] = field(default_factory=list)
    # Something still reading this request's pages and slot in place (a disaggregated prefill's
    # zero-copy sends): while `hold.done` is False, releasing the request defers giving them back.
    hold: Hold | None = None
    # params.logit_bias as (ids, values) tensors on the logits' device, built at its first step
    # (a bias over much of the vocabulary is not rebuilt from a dict every step).
    logit_bias_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # Speculative decoding (engine/core/scheduler_spec.py): the drafts the next step verifies
    # after the last output token, and the scratch slots that keep the recurrent state after
    # each drafted position while it runs (k of them, held from its first verify to its end).
    drafts: list[int] = field(default_factory=list)
    spec_slots: list[int] = field(default_factory=list)
    # Handed over by a PD prefill worker: its first drafts come from the kept hidden state
    # (engine/layers/mtp.py) before its first step.
    draft_from_slot: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        # Produced during a pass over the whole prompt that ends in the first sampled token; a
        # request preempted before that token starts them over (Scheduler.preempt).
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
