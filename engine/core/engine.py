"""The engine: model + pools + scheduler + sampler, advanced one step at a time.

The server's engine process and the offline `LLM` both drive this class:
`add_request`, `abort_request`, `step() -> [RequestDelta]`, `stats()`. Deltas carry token ids;
text and stop strings are the next stage's work (engine/core/detokenizer.py), outside the step loop.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from baton.engine import parallel
from baton.engine.cache.memory import (
    IndexPool,
    size_pools,
)
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model, resolve_dtype
from baton.engine.config import ModelConfig
from baton.engine.core import assembly
from baton.engine.core.engine_args import EngineArgs, EngineStats
from baton.engine.core.outputs import RequestDelta
from baton.engine.core.request import Request
from baton.engine.core.request_checks import check_request
from baton.engine.core.request_timing import RequestTiming
from baton.engine.core.sampler import Sampler, prompt_logprobs_of
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.tokenizer import LazyTokenizer
from baton.engine.core.warm_up import warm_up
from baton.engine.executor.forward_metadata import Mamba2Metadata, ScheduledBatch
from baton.engine.executor.model_runner import ModelRunner
from baton.engine.handover.connector import Handover
from baton.engine.handover.ranks import ShardHandover
from baton.engine.handover.shards import gather_addresses, load_connector
from baton.engine.lora.model import check_adapter, lora_limits
from baton.engine.models.registry import family_named, model_state_spec
from baton.engine.parallel.messages import PoolOps
from baton.engine.parallel.ranks import RankedRunner, start_ranks
from baton.engine.parallel.support import check_tp_supported
from baton.engine.quantization import read_quantization
from baton.engine.runtime.cpu_allocator import (
    keep_freed_memory_in_heap,
    release_freed_memory,
)
from baton.engine.spec_decode.config import SpeculativeConfig
from baton.engine.spec_decode.stats import SpecDecodeCounters
from baton.engine.spec_decode.verifier import sample_step
from baton.engine.structured_output.grammars import Grammars

logger = logging.getLogger("baton.engine")


class Engine:
    """The parts, each owning its data: the scheduler (every request and its state), the
    executor (model runner, graph runner, metadata), the pools, the sampler, and the handover
    connector that a disaggregation worker drives (`self.handover`)."""

    def __init__(
        self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu", **engine_args
    ):
        logger.info("loading %s (%s, %s)", model_dir, dtype, device)
        self.args = EngineArgs(**engine_args)
        # rank 0's device: GPU 0 when every rank has a GPU of its own (NCCL), else `device`
        self.device = parallel.rank_device(device, 0, self.args.tensor_parallel_size)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.model_dir = Path(model_dir)
        checkpoint = ModelConfig.from_hf(model_dir)
        self.speculative = (
            SpeculativeConfig.for_checkpoint(
                self.args.speculative_config, checkpoint.num_nextn_predict_layers
            )
            if self.args.speculative_config is not None
            else None
        )
        with_mtp = self.speculative is not None and self.speculative.method == "mtp"
        # The MTP head, its weights and its state exist only when speculation drafts with it.
        self.model_config = checkpoint.with_mtp(with_mtp)
        self.dtype = resolve_dtype(dtype, self.model_config)
        args, config = self.args, self.model_config
        # read (and refused, if it must be) before any process starts
        self.quantization = read_quantization(
            model_dir, args.quantization, family_named(config.architecture).checkpoint_name
        )
        self.state_spec = model_state_spec(config, self.dtype)
        budget = assembly.pool_budget(
            args, config, self.state_spec, self.device, self.model_dir, self.dtype,
            self.quantization, self.speculative,
        )  # fmt: skip
        sizes = size_pools(
            max_total_tokens=budget.tokens, max_mamba_slots=budget.slots, page_size=args.page_size
        )
        # Before any process starts: a model and TP size that cannot be served are refused.
        check_tp_supported(config, args.tensor_parallel_size)
        self.ranks = start_ranks(model_dir, dtype, device, args, sizes, with_mtp)
        tp = self.ranks.tp if self.ranks is not None else parallel.SINGLE
        try:
            self.model = load_model(
                model_dir,
                self.dtype,
                self.device,
                tp,
                with_mtp=with_mtp,
                quantization=args.quantization,
                lora=lora_limits(args),
            )
            for name, path in (args.lora_modules or {}).items():
                self.model.adapters.add(name, path)
            if self.ranks is not None:
                self.ranks.wait_loaded()
            if with_mtp and self.model.mtp is None:
                raise ValueError(
                    f"{config.architecture}: baton has no MTP head for this family yet"
                    " (speculative method 'ngram' works for every family)"
                )
        except BaseException:
            self.close()
            raise
        if self.device.type == "cpu":
            release_freed_memory()  # the plain weights the packed ones replaced
        self.lazy_tokenizer = LazyTokenizer(model_dir)
        self.cache = StateCache(
            self.state_spec,
            num_pages=sizes.num_pages,
            page_size=sizes.page_size,
            num_slots=sizes.num_mamba_slots,
            device=self.device,
            tp_size=tp.size,
            tp_rank=tp.rank,
        )
        logger.info(
            "pools: %d KV tokens, %d state slots, %.0f MiB reserved (committed as used on the CPU)",
            # (with two page tables a token takes a page slot in each: spec.page_tables)
            (sizes.num_pages - 1) // self.state_spec.page_tables * sizes.page_size,
            sizes.num_mamba_slots - 1,
            self.cache.nbytes() / 2**20,
        )
        self.shard_connector = load_connector(
            args.handover_connector, config, tp.rank, tp.size, self.cache
        )
        # every rank's shard receive address, rank 0's first (after each rank's connector)
        shard_addresses = gather_addresses(tp, self.shard_connector)
        # The scheduler's pool operations, recorded for the other ranks' next step at TP > 1.
        self.pool_ops = PoolOps(self.cache, record=self.ranks is not None)
        if self.ranks is not None and self.model.adapters is not None:
            self.model.adapters.on_write = self.pool_ops.adapter_slot
        # A model with no paged state (no attention layer) holds no pages: no page accounting,
        # and its context is not bounded by a page budget.
        paged = self.state_spec.has_pages
        self.pages = IndexPool(sizes.num_pages - 1 if paged else 0, "KV pages")
        self.slots = IndexPool(sizes.num_mamba_slots - 1, "state slots")
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        if paged:  # (every page table's page for each position: ModelStateSpec.page_tables)
            self.max_model_len = min(
                self.max_model_len,
                (sizes.num_pages - 1) // self.state_spec.page_tables * sizes.page_size,
            )
        self.prefix_cache = assembly.make_prefix_cache(
            args, self.state_spec, self.pages, self.slots
        )
        self.tiers = assembly.make_tiers(
            args,
            self.prefix_cache,
            self.cache,
            config,
            self.model_dir,
            self.dtype,
            self.quantization is not None and self.quantization.online,
        )
        # structured outputs (engine/structured_output/): compiles off the loop, masks per step
        self.grammars = Grammars(
            self.lazy_tokenizer,
            config.vocab_size,
            config.eos_token_ids,
            compile_threads=1 if self.device.type == "cpu" else 8,
        )
        self.refused: list[tuple[str, str]] = []  # (request id, why) for take_refused
        self.scheduler = Scheduler(
            assembly.scheduler_config(
                args, config, self.device, self.state_spec, self.max_model_len
            ),
            self.pages,
            self.slots,
            self.pool_ops,
            prefix_cache=self.prefix_cache,
            constraint=self.grammars,
            speculation=assembly.spec_schedule(self.speculative),
            adapters=self.model.adapters,
        )
        model_runner = ModelRunner(self.model, self.cache, self.device)
        self.runner = model_runner
        if self.ranks is not None:
            self.runner = RankedRunner(model_runner, self.ranks, self.pool_ops)
        self.drafter = assembly.make_drafter(self.speculative, self.runner, self.max_model_len)
        self.spec_counters = SpecDecodeCounters()
        self.graph_runner = assembly.make_graph_runner(
            args, self.device, model_runner, self.max_model_len, self.state_spec, self.speculative
        )
        if self.ranks is not None and self.graph_runner is not None:
            self.ranks.send_message(assembly.use_graphs(self.graph_runner))
        self.sampler = Sampler(args.seed, self.device)
        self.timing = RequestTiming() if args.request_timing else None
        self._arrivals = 0
        self.checkpoints_by_mode: dict[str, int] = {"extend": 0, "decode": 0, "mixed": 0}
        self.handover = Handover(
            model_dir=self.model_dir,
            config=config,
            dtype=self.dtype,
            cache=self.cache,
            scheduler=self.scheduler,
            sampler=self.sampler,
            grammars=self.grammars,
            new_request=self._new_request,
            online_quantization=self.quantization is not None and self.quantization.online,
            shards=ShardHandover(
                cache=self.cache,
                scheduler=self.scheduler,
                pool_ops=self.pool_ops,
                ranks=self.ranks,
                connector=self.shard_connector,
                addresses=shard_addresses,
            ),
        )

    def warm_up(self) -> None:
        """Pay the first forward's one-time costs now (C kernel builds, Triton compiles:
        engine/core/warm_up.py); the engine processes call this before they report ready."""
        began = time.perf_counter()
        forwards = warm_up(self)
        logger.info("warm-up: %d forwards in %.2f s", forwards, time.perf_counter() - began)

    def check_ranks(self) -> None:
        """Raise RankFailed if a tensor-parallel rank has exited (a waitpid per rank)."""
        if self.ranks is not None:
            self.ranks.check_alive()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing at TP=1); idempotent."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.stop("engine closed")
        if getattr(self, "shard_connector", None) is not None:
            self.shard_connector.close()
            self.shard_connector = None
        if getattr(self, "grammars", None) is not None:
            self.grammars.close()
        if getattr(self, "tiers", None) is not None:
            self.tiers.persist()  # the pools' idle blocks too: a restart finds them
            self.tiers.close()  # (the queued writes first)
            self.tiers = None

    def reset_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # -- requests ---------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        """The requests not finished yet, by id (the scheduler's)."""
        return self.scheduler.requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        req = self._new_request(request_id, prompt_token_ids, params)
        self.scheduler.register(req)
        self.grammars.add(req)  # structured outputs: scheduled once the grammar is compiled
        self.grammars.hold(req, self.scheduler.enqueue)
        if self.timing is not None:
            self.timing.added(request_id)

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (AdapterError, a ValueError, names what
        is refused)."""
        if self.model.adapters is None:
            raise ValueError("loading a LoRA adapter needs enable_lora (--enable-lora)")
        self.model.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        if self.model.adapters is None:
            raise ValueError("unloading a LoRA adapter needs enable_lora (--enable-lora)")
        users = sum(r.params.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"adapter {name!r} is in use by {users} unfinished request(s)")
        self.model.adapters.remove(name)
        if self.prefix_cache is not None:  # a later adapter of that name is another adapter
            self.prefix_cache.drop_adapter(name)

    def list_loras(self) -> list[str]:
        return [] if self.model.adapters is None else self.model.adapters.names()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with this request; nothing is created."""
        check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        check_adapter(params.lora_name, self.model.adapters)
        self.grammars.check(params)

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        req = Request(
            request_id=request_id,
            prompt_ids=list(prompt_token_ids),
            params=params,
            arrival=self._arrivals,
        )
        self._arrivals += 1
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return req

    def abort_request(self, request_id: str) -> None:
        self.grammars.forget(request_id)  # (held while its grammar compiles: not scheduled yet)
        self.scheduler.abort(request_id)
        if self.timing is not None:
            self.timing.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.grammars.num_held > 0

    def take_refused(self) -> list[tuple[str, str]]:
        """(request id, reason) of the requests ended since the last call because their grammar
        turned out unusable once compiled (the server answers each with a 400)."""
        refused, self.refused = self.refused, []
        return refused

    def stats(self) -> EngineStats:
        cache = self.prefix_cache
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.pages.used - (cache.idle_pages if cache else 0),
            kv_pages_total=self.pages.capacity,
            mamba_slots_used=self.slots.used - (cache.idle_slots if cache else 0),
            mamba_slots_total=self.slots.capacity,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.scheduler.prompt_tokens_total,
            generation_tokens_total=self.scheduler.generation_tokens_total,
            prefix_cache_blocks=len(cache.blocks) if cache else 0,
            prefix_cache_query_tokens=cache.stats.query_tokens if cache else 0,
            prefix_cache_hit_tokens=cache.stats.hit_tokens if cache else 0,
            prefix_cache_evictions=cache.stats.evicted_blocks if cache else 0,
            mamba_checkpoints_extend=self.checkpoints_by_mode["extend"],
            mamba_checkpoints_decode=self.checkpoints_by_mode["decode"]
            + (self.scheduler.blocks.verified_checkpoints if self.scheduler.blocks else 0),
            mamba_checkpoints_mixed=self.checkpoints_by_mode["mixed"],
            spec_decode_num_drafts=self.spec_counters.num_drafts,
            spec_decode_num_draft_tokens=self.spec_counters.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_counters.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_counters.accepted_per_pos),
        )

    def tier_stats(self) -> dict[str, int | float]:
        """The tiers' counters (engine/cache/tier_stats.py); empty without tiers."""
        return self.tiers.stats() if self.tiers is not None else {}

    def timing_stats(self) -> dict[str, float]:
        """The request timing histograms (engine/core/request_timing.py); empty when off."""
        return self.timing.as_stats() if self.timing is not None else {}

    # -- one step ---------------------------------------------------------------------------

    def forward(self, sched: ScheduledBatch) -> tuple[Mamba2Metadata, torch.Tensor]:
        """One scheduled batch through the model: the graph runner's padded step (a CUDA graph
        or a CPU plan, replayed) where it takes the batch, else the eager runner."""
        graphs = self.graph_runner
        local = graphs.forward if graphs is not None and graphs.can_run(sched) else None
        if self.ranks is not None:  # the step to every rank first (RankedRunner)
            return self.runner.forward(sched, local)
        return (local or self.runner.forward)(sched)

    def step(self) -> list[RequestDelta]:
        for req, reason in self.grammars.release():  # compiled grammars start their requests
            self.abort_request(req.request_id)
            self.refused.append((req.request_id, reason))
        if self.drafter is not None:
            self._draft_handed_over()
        sched = self.scheduler.schedule()
        if sched is None:
            self.grammars.wait()  # nothing to run but grammars to compile: no busy loop
            if self.tiers is not None and self.tiers.reading:
                time.sleep(0.001)  # ... or a cached prefix to read from a file
            return []
        if self.timing is not None:
            self.timing.scheduled(sched)
        md, logits = self.forward(sched)
        if sched.track_points:  # (a verify step's are its decode rows')
            mode = "decode" if sched.mode == "verify" else sched.mode
            self.checkpoints_by_mode[mode] += len(sched.track_points)
        reqs = [self.scheduler.requests[rid] for rid in sched.request_ids]
        rows_of: dict[int, list[int]] = {}
        for row, owner in enumerate(md.forward.batch.logits_row_owner):
            rows_of.setdefault(owner, []).append(row)

        prompt_logprobs = {}
        for s in sched.prompt_logprob_seqs:
            rows = rows_of[s]  # increasing; consecutive for a prefill: a view, not a copy
            consecutive = rows[-1] - rows[0] + 1 == len(rows)
            own = logits[rows[0] : rows[-1] + 1] if consecutive else logits[rows]
            prompt_logprobs[s] = prompt_logprobs_of(reqs[s], sched.start_positions[s], own)

        sampled = {}
        if sched.logits_seqs:
            sampled, verified = sample_step(
                self.sampler,
                self.grammars,
                logits,
                sched,
                reqs,
                rows_of,
                self.model_config.eos_token_ids,
                self.model_config.vocab_size,
            )
            self.spec_counters.count(verified)
        drafts = {}
        if self.drafter is not None and self.scheduler.speculating():
            # before the scheduler takes the tokens: a finishing prefill's snapshot (PD) holds
            # the MTP head's K/V of its whole prompt
            drafts = self.drafter.propose(sched, reqs, sampled)
        deltas = self.scheduler.update_from_output(sched, sampled, prompt_logprobs, drafts)
        if self.timing is not None:
            for delta in deltas:
                self.timing.sampled(delta.request_id, finished=delta.finished)
        return deltas

    def _draft_handed_over(self) -> None:
        """Requests a PD prefill worker computed draft before their first step here, from the
        state that came with them (the MTP head's K/V over the prompt and the last hidden
        state), as they would have after a local prefill."""
        ready = [
            req
            for req in self.scheduler.running
            if req.draft_from_slot and self.scheduler.reserve_draft_pages(req)
        ]
        if ready and self.scheduler.speculating():
            for req, drafts in zip(ready, self.drafter.propose_from_slots(ready)):
                self.scheduler.set_drafts(req, drafts)
