"""A tensor-parallel rank other than 0: `python -m baton.engine.parallel.worker SPEC_JSON`, started and
stopped by rank 0 (engine/parallel/ranks.py).

It joins the rank group (gloo; NCCL beside it for the all-reduces with a GPU per rank), loads its shard of the model, sizes its pools like rank 0's (its
shard of each KV head and Mamba state), then follows rank 0 step by step:

    PULL RankStep ─> apply pool operations ─> build metadata (the one builder) ─> forward
                                                          collectives with every rank ─┘

It exits on RankShutdown, when rank 0's process dies (PR_SET_PDEATHSIG plus a parent-pid
check), and when a collective fails (a peer died, or hung past the timeout).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch
import zmq

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model, resolve_dtype
from baton.engine.config import ModelConfig
from baton.engine.executor.draft_batch import DraftBatch
from baton.engine.executor.graph_runner import DecodeGraphRunner
from baton.engine.executor.model_runner import ModelRunner
from baton.engine.handover.shards import (
    ConnectorSpec,
    apply_handover,
    gather_addresses,
    install_report,
    load_connector,
)
from baton.engine.lora.model import LoRALimits
from baton.engine.models.registry import model_state_spec
from baton.engine.parallel.messages import (
    CopySlot,
    InstallShard,
    LoadAdapterSlot,
    RankShutdown,
    RankSpec,
    ReportPools,
    ResetSlot,
    UseGraphs,
    apply,
    decode,
    pool_digest,
)
from baton.engine.runtime.gc_freeze import freeze_startup_objects
from baton.engine.runtime.socket_limits import ReceiveLimits, limit, receive

logger = logging.getLogger("baton.tp_worker")

POLL_MS = 200  # idle wait between parent checks


def step_limits(spec: RankSpec) -> ReceiveLimits:
    """A RankStep is one frame: a step's batch (a few ids per token, per page and per slot it
    uses: no more than the pools hold) and the pool operations since the last one. Its only
    sender is rank 0, over an ipc file in a directory only this user can enter: a backstop."""
    positions = spec.num_pages * spec.page_size + spec.num_mamba_slots
    return ReceiveLimits(
        name=f"rank {spec.rank} steps",
        max_part_bytes=256 * positions + (16 << 20),
        max_parts=1,
        max_queued=1000,
    )


def run(spec: RankSpec) -> int:
    torch.set_num_threads(spec.threads)
    device = parallel.rank_device(spec.device, spec.rank, spec.size)
    tp = parallel.connect(
        spec.rank, spec.size, spec.store_port, spec.timeout_s, spec.load_timeout_s, device
    )
    config = ModelConfig.from_hf(spec.model).with_mtp(spec.with_mtp)
    dtype = resolve_dtype(spec.dtype, config)
    model = load_model(
        spec.model,
        dtype,
        device,
        tp,
        with_mtp=spec.with_mtp,
        quantization=spec.quantization,
        lora=LoRALimits(**spec.lora) if spec.lora is not None else None,
    )
    cache = StateCache(
        model_state_spec(config, dtype),
        num_pages=spec.num_pages,
        page_size=spec.page_size,
        num_slots=spec.num_mamba_slots,
        device=device,
        tp_size=tp.size,
        tp_rank=tp.rank,
    )
    runner = ModelRunner(model, cache, device)
    wire = spec.handover_connector
    connector = load_connector(
        ConnectorSpec.from_wire(wire) if wire is not None else None,
        config,
        spec.rank,
        spec.size,
        cache,
    )
    context = zmq.Context()
    limits = step_limits(spec)
    steps = limit(context.socket(zmq.PULL), limits)
    steps.connect(spec.step_addr)
    tp.barrier(spec.load_timeout_s)
    gather_addresses(tp, connector)  # rank 0 learns where this rank receives shards
    freeze_startup_objects()
    graphs = None  # rank 0's padded runner, built alike when it says so (UseGraphs)
    try:
        while True:
            if not steps.poll(POLL_MS):
                if os.getppid() != spec.parent_pid:
                    logger.warning("rank %d: rank 0 (pid %d) is gone", spec.rank, spec.parent_pid)
                    return 0
                continue
            frames = receive(steps, limits)  # rank 0 is the only peer
            if frames is None:
                continue
            message = decode(frames[0])
            if isinstance(message, RankShutdown):
                return 0
            if isinstance(message, ReportPools):
                tp.gather_last_dim(pool_digest(cache))
                continue
            if isinstance(message, UseGraphs):
                graphs = DecodeGraphRunner(
                    runner,
                    max_bs=message.max_bs,
                    kv_capacity=message.kv_capacity,
                    capture=message.capture,
                    verify_width=message.verify_width,
                )
                continue
            for op in message.ops:
                if isinstance(op, (ResetSlot, CopySlot)):
                    apply(op, cache)
                    continue
                if isinstance(op, LoadAdapterSlot):
                    model.adapters.install(op.slot, op.name, op.path)
                    continue
                error = apply_handover(op, cache, connector)
                if isinstance(op, InstallShard):
                    install_report(tp, error, connector)
            if isinstance(message.batch, DraftBatch):
                runner.draft(message.batch)
            elif message.batch is not None:  # the runner rank 0 chose, by the same rule
                if graphs is not None and graphs.can_run(message.batch):
                    graphs.forward(message.batch)
                else:
                    runner.forward(message.batch)
    finally:
        if connector is not None:
            connector.close()
        steps.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = RankSpec.from_json(argv[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from baton.engine.runtime.process import _die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the group: rank 0 decides
    _die_with_parent()
    try:
        return run(spec)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
