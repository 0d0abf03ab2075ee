"""What an engine is built from and what it reports: `EngineArgs` (the serving knobs, with their
defaults, checked at the boundary) and `EngineStats` (a snapshot of its pools and counters)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.engine.cache.tier_config import TierConfig, tier_config
from baton.engine.core.scheduler import SCHEDULE_POLICIES, SchedulePolicy

if TYPE_CHECKING:
    from baton.engine.handover.shards import ConnectorSpec


@dataclass(kw_only=True)
class EngineArgs:
    """Serving knobs; defaults live here, at the boundary (CLI flags use the same names)."""

    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int = 512
    max_running_requests: int = 128
    max_total_tokens: int | None = None
    max_mamba_slots: int | None = None
    # Memory the KV and state pools may take, in bytes (vLLM's flag); None: --mem-fraction of
    # the free GPU memory, or DEFAULT_CPU_POOL_BYTES on the CPU (engine/cache/memory.py).
    kv_cache_memory_bytes: int | None = None
    page_size: int = 16
    seed: int = 0
    mem_fraction: float = 0.85  # of the free GPU memory (CPU: of the available memory)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # default: max_running_requests
    cpu_padded_decode: bool = False  # run CPU decode steps through the padded graph runner
    # CPU: decode and verify steps up to cuda_graph_max_bs (default CPU_CAPTURE_MAX_BS) rows
    # replayed from a recorded plan (engine/executor/cpu_plan.py) instead of eagerly
    cpu_step_capture: bool = True
    enable_prefix_caching: bool = True
    # "mixed" (vLLM V1): decodes first, then new prefills with the rest of the budget;
    # "prefill-first" (SGLang): while requests wait, a step runs prefills only (engine/core/scheduler.py)
    schedule_policy: SchedulePolicy = "mixed"
    # Token budget of a prefill-first step (SGLang's --max-prefill-tokens). Default: 512 on the
    # CPU, where a prefill step's time grows linearly with its tokens from a few hundred on
    # (110M model: ~0.58 ms a token at 512 and at 2048), so smaller steps give the first
    # requests of a burst their tokens sooner for little throughput; max_num_batched_tokens
    # elsewhere.
    max_prefill_tokens: int | None = None
    request_timing: bool = False  # per-request queue / prefill / decode histograms in stats
    mamba_track_interval: int | None = None  # default: a multiple of chunk and page near 512
    tensor_parallel_size: int = 1  # ranks, one process each; rank 0 is this process
    # vLLM's --quantization (fp8, modelopt, modelopt_fp4, modelopt_mixed); None: as the
    # checkpoint is stored (engine/quantization)
    quantization: str | None = None
    # A collective that waits longer fails the engine (a rank hung); above the slowest real
    # step (a 2048-token prefill of a 110M model takes ~2.3 s on 2 CPU cores).
    tp_timeout: float = 60.0
    tp_load_timeout: float = 600.0  # how long the ranks may take to start and load
    # What builds each rank's handover connector (engine/handover/shards.py ConnectorSpec): a
    # disaggregated worker's ranks send or receive their own shards. None: no handover.
    handover_connector: ConnectorSpec | None = None
    # vLLM's --speculative-config as a dict ({"method": "mtp" | "ngram", "num_speculative_tokens":
    # k, ...}: engine/spec_decode/config.py); None: no speculative decoding
    speculative_config: dict | None = None
    # LoRA adapters (engine/lora/), vLLM's flags: each row of a step applies its own adapter
    enable_lora: bool = False
    max_loras: int = 1  # adapters in the slot table at once
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in host memory (default: max_loras)
    lora_modules: dict[str, str] | None = None  # name -> PEFT directory, loaded at start
    # Tiers under the pools (engine/cache/tiers.py), SGLang's flags: evicted prefix blocks go to
    # host memory (hicache_size GiB) and/or files (hicache_storage_backend "file" in
    # hicache_storage_dir, within hicache_storage_size GiB); checked by tier_config
    enable_hierarchical_cache: bool = False
    hicache_size: float | None = None
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_size: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "chunked_prefill_size",
            "max_running_requests",
            "page_size",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.tier_config() is not None and self.enable_lora:  # ValueError naming the flag
            raise ValueError(
                "--enable-hierarchical-cache with --enable-lora is not supported: the tiers' "
                "files are keyed by the base model's tokens"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                f"got {self.schedule_policy!r}"
            )

    def tier_config(self) -> TierConfig | None:
        return tier_config(
            enable=self.enable_hierarchical_cache,
            host_gib=self.hicache_size,
            backend=self.hicache_storage_backend,
            storage_dir=self.hicache_storage_dir,
            storage_gib=self.hicache_storage_size,
            prefix_caching=self.enable_prefix_caching,
            tensor_parallel_size=self.tensor_parallel_size,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineStats:
    """Pool usage counts what requests hold; idle prefix-cache blocks count as free (like vLLM)."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    mamba_slots_used: int
    mamba_slots_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_blocks: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    # Mamba checkpoints the forward wrote, by the kind of step that wrote them: a cache hit past
    # a prompt's own blocks resumes from one written in a decode or mixed step (the seed bug's
    # ground), so tests and operators can see that those steps checkpoint at all.
    mamba_checkpoints_extend: int
    mamba_checkpoints_decode: int
    mamba_checkpoints_mixed: int
    # Speculative decoding, as vLLM counts it (engine/spec_decode/stats.py): verify rows run,
    # tokens they drafted and accepted, and per draft position how often it was accepted.
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...]


def default_track_interval(chunk_size: int, page_size: int, target: int = 512) -> int:
    step = math.lcm(chunk_size, page_size)
    return step * max(1, target // step)
