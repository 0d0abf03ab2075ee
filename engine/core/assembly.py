"""How the engine's parts are sized and chosen from its arguments, its model and its device: the
pools' budget, the prefix cache and the tiers under it, the padded-decode graph runner, and
speculation's schedule and drafter. `Engine.__init__` (engine/core/engine.py) calls each once, in
that order of need; none keeps state of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from baton.engine.cache.memory import (
    DEFAULT_CPU_POOL_BYTES,
    IndexPool,
    PoolBudget,
    budget_pools,
)
from baton.engine.cache.pools import StateCache
from baton.engine.cache.prefix_cache import PrefixCache
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.cache.tier_files import FileStore
from baton.engine.cache.tier_records import TierIdentity, TierLayout
from baton.engine.cache.tiers import HostStore, Tiers
from baton.engine.checkpoint.fingerprint import config_fingerprint, weights_fingerprint
from baton.engine.config import ModelConfig
from baton.engine.core.engine_args import EngineArgs, default_track_interval
from baton.engine.core.scheduler import SchedulerConfig
from baton.engine.core.scheduler_spec import SpecSchedule
from baton.engine.executor.cpu_plan import plans_available
from baton.engine.executor.graph_runner import CPU_CAPTURE_MAX_BS, DecodeGraphRunner
from baton.engine.handover.io import StateIO
from baton.engine.lora.model import lora_limits, slot_table_bytes
from baton.engine.models.registry import family_named
from baton.engine.parallel.messages import UseGraphs
from baton.engine.quantization import weight_bytes
from baton.engine.runtime.cpu_allocator import available_memory
from baton.engine.spec_decode.config import SpeculativeConfig
from baton.engine.spec_decode.drafters import Drafter, NgramStepDrafter
from baton.engine.spec_decode.mtp import MtpDrafter


def pool_budget(
    args: EngineArgs,
    config: ModelConfig,
    state_spec: ModelStateSpec,
    device: torch.device,
    model_dir: Path,
    dtype: torch.dtype,
    quantization,
    speculative: SpeculativeConfig | None,
) -> PoolBudget:
    """The pools' sizes from the state spec and the context budget (engine/cache/memory.py),
    within --kv-cache-memory-bytes, else --mem-fraction of the free GPU memory, else on the
    CPU DEFAULT_CPU_POOL_BYTES (at most --mem-fraction of the available memory)."""
    if args.kv_cache_memory_bytes is not None:
        memory = args.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what the weights will take (quantized as they are stored) is not the pools'
        rename = family_named(config.architecture).checkpoint_name
        weights = weight_bytes(model_dir, dtype, quantization, rename, args.tensor_parallel_size)
        weights += slot_table_bytes(model_dir, lora_limits(args), dtype, args.tensor_parallel_size)
        memory = int(free * args.mem_fraction - weights)
        if memory <= 0:
            raise ValueError(
                f"the weights take about {weights / 2**30:.2f} GiB on each rank, more than "
                f"--mem-fraction {args.mem_fraction} of the {free / 2**30:.2f} GiB free on "
                f"{device}: raise --mem-fraction, shard the model (--tp) or quantize "
                "it (--quantization fp8)"
            )
    else:
        memory = min(DEFAULT_CPU_POOL_BYTES, int(available_memory() * args.mem_fraction))
    return budget_pools(
        token_bytes=state_spec.bytes_per_page_token(),
        slot_bytes=state_spec.bytes_per_slot(),
        memory_bytes=memory,
        max_running_requests=args.max_running_requests,
        max_model_len=args.max_model_len or config.max_position_embeddings,
        prefix_cache=args.enable_prefix_caching,
        max_total_tokens=args.max_total_tokens,
        max_mamba_slots=args.max_mamba_slots,
        slots_per_request=1 + (speculative.num_speculative_tokens if speculative else 0),
        page_tables=state_spec.page_tables,
    )


def make_prefix_cache(
    args: EngineArgs, state_spec: ModelStateSpec, pages: IndexPool, slots: IndexPool
) -> PrefixCache | None:
    if not args.enable_prefix_caching:
        return None
    chunk = state_spec.chunk_size
    interval = args.mamba_track_interval or default_track_interval(chunk, args.page_size)
    if interval % chunk or interval % args.page_size:
        raise ValueError(
            f"mamba_track_interval {interval} must be a multiple of the state's chunk size "
            f"{chunk} and of the KV page size {args.page_size}"
        )
    return PrefixCache(
        track_interval=interval,
        page_size=args.page_size,
        pages=pages,
        slots=slots,
        page_tables=state_spec.page_tables,
    )


def make_tiers(
    args: EngineArgs,
    prefix_cache: PrefixCache | None,
    cache: StateCache,
    config: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype,
    online_quantization: bool,
) -> Tiers | None:
    """The tiers under the pools (engine/cache/tiers.py) the tier flags ask for, attached to the
    prefix cache; their records are named for this model, its weights, dtype and layout."""
    tiers = args.tier_config()
    if tiers is None or prefix_cache is None:
        return None
    layout = TierLayout.of(cache, prefix_cache.pages_per_block)
    identity = TierIdentity.of(
        config_fingerprint=config_fingerprint(config),
        weights_fingerprint=weights_fingerprint(
            model_dir,
            family_named(config.architecture).checkpoint_name,
            "online fp8" if online_quantization else "",
        ),
        dtype=dtype,
        page_size=cache.page_size,
        track_interval=prefix_cache.track_interval,
        layout=layout,
    )
    stores: list = []
    if tiers.host_bytes is not None:
        stores.append(HostStore(tiers.host_bytes))
    if tiers.storage_dir is not None:
        stores.append(FileStore(tiers.storage_dir, tiers.storage_bytes, identity, layout))
    return Tiers(
        cache=prefix_cache, io=StateIO(cache), identity=identity, layout=layout, stores=stores
    )


def make_graph_runner(
    args: EngineArgs,
    device: torch.device,
    runner,
    max_model_len: int,
    state_spec: ModelStateSpec,
    speculative: SpeculativeConfig | None,
) -> DecodeGraphRunner | None:
    """CUDA graphs on a GPU, or the padded decode runner on the CPU when asked; else None.
    Speculating, verify steps (k + 1 tokens a row) run through it as well."""
    # CUDA graphs stay single-rank (a graph over the ranks' NCCL all-reduces is not done yet);
    # CPU plans replay the ranks' collectives (engine/parallel: functional collectives).
    on_cuda = (
        device.type == "cuda" and not args.disable_cuda_graph and args.tensor_parallel_size == 1
    )
    capture = "cuda" if on_cuda else None
    # A step whose decode attention reads a mask (no C kernel for it) would attend over the
    # whole fixed capacity in a plan: it stays eager and tight.
    if (
        device.type == "cpu"
        and args.cpu_step_capture
        and plans_available()
        and not runner.decode_reads_mask()
    ):
        capture = "cpu"
    if capture is None and not args.cpu_padded_decode:
        return None
    page = args.page_size
    # With no paged state no page table has a column.
    pages = -(-max_model_len // page) if state_spec.has_pages else 0
    return DecodeGraphRunner(
        runner,
        max_bs=min(
            args.cuda_graph_max_bs
            or (CPU_CAPTURE_MAX_BS if capture == "cpu" else args.max_running_requests),
            args.max_running_requests,
        ),
        kv_capacity=pages * page,
        capture=capture,
        verify_width=speculative.num_speculative_tokens + 1 if speculative else None,
    )


def use_graphs(graphs: DecodeGraphRunner) -> UseGraphs:
    """The message that has every other tensor-parallel rank build `graphs`' twin."""
    return UseGraphs(
        max_bs=graphs.max_bs,
        kv_capacity=graphs.kv_capacity,
        capture=graphs.capture,
        verify_width=graphs.verify_width,
    )


def spec_schedule(speculative: SpeculativeConfig | None) -> SpecSchedule | None:
    if speculative is None:
        return None
    k = speculative.num_speculative_tokens
    return SpecSchedule(
        num_speculative_tokens=k,
        disable_by_batch_size=speculative.disable_by_batch_size,
        draft_lookahead=k - 1 if speculative.method == "mtp" else 0,
    )


def make_drafter(
    speculative: SpeculativeConfig | None, runner, max_model_len: int
) -> Drafter | None:
    if speculative is None:
        return None
    if speculative.method == "mtp":
        return MtpDrafter(speculative, runner, max_model_len)
    return NgramStepDrafter(speculative, max_model_len)


def scheduler_config(
    args: EngineArgs,
    config: ModelConfig,
    device: torch.device,
    state_spec: ModelStateSpec,
    max_model_len: int,
) -> SchedulerConfig:
    """The scheduler's limits: a chunk never exceeds the step's budget; a prefill-first step
    takes 512 tokens on the CPU (the whole budget on a GPU) unless told; a model with no paged
    state schedules no pages; one whose paged state all sits behind sliding windows releases
    the pages behind them (the spec's page_window)."""
    paged = state_spec.has_pages
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill_size=min(args.chunked_prefill_size, args.max_num_batched_tokens),
        max_running_requests=args.max_running_requests,
        page_size=args.page_size if paged else None,
        page_tables=state_spec.page_tables,
        page_window=state_spec.page_window if paged else None,
        policy=args.schedule_policy,
        max_prefill_tokens=min(
            args.max_prefill_tokens
            or (512 if device.type == "cpu" else args.max_num_batched_tokens),
            args.max_num_batched_tokens,
        ),
        max_model_len=max_model_len,
        eos_token_ids=config.eos_token_ids,
    )
