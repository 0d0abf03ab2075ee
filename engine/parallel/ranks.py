"""Rank 0's side of tensor parallelism: start ranks 1..N-1 (engine/parallel/worker.py), send each of
them every step, notice when one dies or hangs, stop them.

    Engine (rank 0) ── RankedRunner.forward(sched) ──┬─ RankStep (PUSH, one socket per rank)
                                                     └─ its own forward; the collectives wait
                                                        for every rank, at most `timeout_s`

A rank that exits or hangs makes rank 0's collective raise; `RankFailed` then says which rank
and how (its exit code, or the timeout), the engine loop reports it to every request and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import zmq

from baton.engine import parallel
from baton.engine.cache.memory import PoolSizes
from baton.engine.executor.draft_batch import DraftBatch
from baton.engine.executor.forward_metadata import Mamba2Metadata, ScheduledBatch
from baton.engine.executor.model_runner import ModelRunner
from baton.engine.lora.model import lora_limits
from baton.engine.parallel.messages import (
    PoolOps,
    RankShutdown,
    RankSpec,
    RankStep,
    ReportPools,
    UseGraphs,
    encode,
    pool_digest,
)
from baton.engine.runtime.cpu_threads import engine_environment
from baton.engine.runtime.socket_limits import SEND_ONLY, limit

logger = logging.getLogger("baton.tp")

STOP_WAIT_S = 5.0  # how long a rank may take to exit after RankShutdown before it is killed


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the message says which."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def threads_per_rank(size: int) -> int:
    """Each rank's share of this engine's threads (one per rank on a 2-core machine): the
    ranks divide what the engine process was given (--cpu-threads, else one per core)."""
    return max(1, torch.get_num_threads() // size)


class Ranks:
    """Ranks 1..size-1 as child processes, and rank 0's membership of their group."""

    def __init__(
        self,
        *,
        model: str,
        dtype: str,
        device: str,
        size: int,
        timeout_s: float,
        load_timeout_s: float,
        sizes: PoolSizes,
        handover_connector: dict[str, str] | None,
        with_mtp: bool,
        quantization: str | None,
        lora: dict[str, int] | None,
    ):
        self.size = size
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        # Step sockets are ipc files in a directory only this user can enter: a TCP port on
        # 127.0.0.1 let any local user connect and take every other step from a rank.
        self.step_dir = tempfile.mkdtemp(prefix="baton-tp-")
        port = free_port()
        threads = threads_per_rank(size)
        try:
            for rank in range(1, size):
                sock = limit(self.context.socket(zmq.PUSH), SEND_ONLY)
                # A send waits for the rank's connection (the first step may come before its
                # handshake completes), but never longer than a step may take.
                sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
                sock.bind(f"ipc://{self.step_dir}/rank{rank}")
                self.sockets.append(sock)
                spec = RankSpec(
                    model=str(model),
                    dtype=dtype,
                    device=device,
                    rank=rank,
                    size=size,
                    store_port=port,
                    step_addr=sock.getsockopt_string(zmq.LAST_ENDPOINT),
                    timeout_s=timeout_s,
                    load_timeout_s=load_timeout_s,
                    num_pages=sizes.num_pages,
                    page_size=sizes.page_size,
                    num_mamba_slots=sizes.num_mamba_slots,
                    threads=threads,
                    parent_pid=os.getpid(),
                    handover_connector=handover_connector,
                    with_mtp=with_mtp,
                    quantization=quantization,
                    lora=lora,
                )
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "baton.engine.parallel.worker", spec.to_json()],
                        # OpenMP reads its thread count and wait policy as torch loads. The
                        # rank's share replaces the engine's own OMP_NUM_THREADS (its share
                        # comes from that: the whole engine's threads over its ranks).
                        env=engine_environment(
                            {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                            threads,
                        ),
                    )
                )
            with self.failures("joining the tensor-parallel group"):
                self.tp = parallel.connect(
                    0, size, port, timeout_s, join_timeout_s=load_timeout_s, device=device
                )
        except BaseException:
            self.stop("startup failed")
            raise
        torch.set_num_threads(threads)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def wait_loaded(self) -> None:
        """Every rank has loaded its shard and sized its pools."""
        with self.failures("loading the model shards"):
            self.tp.barrier(self.load_timeout_s)

    def send(self, step: RankStep) -> None:
        self.send_message(step)

    def send_message(self, message: RankStep | ReportPools | UseGraphs) -> None:
        self.check_alive()
        frame = encode(message)
        for rank, sock in enumerate(self.sockets, start=1):
            try:
                sock.send(frame)
            except zmq.Again:
                raise RankFailed(f"tensor-parallel rank {rank} is not taking steps") from None

    def pool_digests(self, cache) -> list[torch.Tensor]:
        """Every rank's `pool_digest`, rank 0's (of `cache`) first."""
        self.send_message(ReportPools(reason="pool check"))
        with self.failures("gathering pool digests"):
            digests = self.tp.gather_last_dim(pool_digest(cache))
        return list(digests.chunk(self.size))

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise RankFailed naming the first rank that has exited; `grace_s`: wait that long
        for a rank that is exiting right now."""
        deadline = time.monotonic() + grace_s
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic())) if grace_s else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                raise RankFailed(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                )

    @contextlib.contextmanager
    def failures(self, doing: str) -> Iterator[None]:
        """Turn a failed collective into RankFailed naming the rank that is gone, if one is,
        else the hang timeout."""
        try:
            yield
        except RankFailed:
            raise
        except Exception as error:
            # gloo may see the connection drop a moment before the dead rank can be reaped.
            self.check_alive(grace_s=1.0)
            detail = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            raise RankFailed(
                f"tensor-parallel ranks stopped answering while {doing} "
                f"(timeout {self.timeout_s:g} s): {detail}"
            ) from error

    def stop(self, reason: str) -> None:
        """Ask every rank to exit, kill those that do not; idempotent."""
        frame = encode(RankShutdown(reason=reason))
        for sock in self.sockets:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(frame, zmq.NOBLOCK)
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets = []
        self.procs = []
        self.context.term()
        shutil.rmtree(self.step_dir, ignore_errors=True)
        if getattr(self, "tp", None) is not None:
            self.tp.close()


class RankedRunner:
    """ModelRunner's `forward` at TP > 1: first the whole step to every other rank (the pool
    operations since the last step, then the batch), then rank 0's own forward."""

    def __init__(self, runner: ModelRunner, ranks: Ranks, pool_ops: PoolOps):
        self.runner = runner
        self.model, self.cache, self.config = runner.model, runner.cache, runner.config
        self.ranks = ranks
        self.pool_ops = pool_ops

    def forward(
        self,
        sched: ScheduledBatch,
        local: Callable[[ScheduledBatch], tuple[Mamba2Metadata, torch.Tensor]] | None = None,
    ) -> tuple[Mamba2Metadata, torch.Tensor]:
        """local: how rank 0 runs its part (the graph runner's padded step, which the other
        ranks choose alike: UseGraphs); None: the eager forward."""
        self.ranks.send(RankStep(ops=self.pool_ops.drain(), batch=sched))
        with self.ranks.failures("running a step"):
            return (local or self.runner.forward)(sched)

    def draft(self, batch: DraftBatch) -> torch.Tensor:
        """A drafter forward (speculative decoding's MTP head), on every rank alike."""
        self.ranks.send(RankStep(ops=self.pool_ops.drain(), batch=batch))
        with self.ranks.failures("running a draft step"):
            return self.runner.draft(batch)


def start_ranks(
    model_dir, dtype: str, device: str, args, sizes: PoolSizes, with_mtp: bool
) -> Ranks | None:
    """Ranks 1..N-1 for an engine with `args.tensor_parallel_size` N (EngineArgs); None at
    N = 1. with_mtp: the ranks build the model's MTP head too."""
    if args.tensor_parallel_size == 1:
        return None
    return Ranks(
        model=str(model_dir),
        dtype=dtype,
        device=device,
        size=args.tensor_parallel_size,
        timeout_s=args.tp_timeout,
        load_timeout_s=args.tp_load_timeout,
        sizes=sizes,
        handover_connector=(
            args.handover_connector.to_wire() if args.handover_connector is not None else None
        ),
        with_mtp=with_mtp,
        quantization=args.quantization,
        lora=None if (limits := lora_limits(args)) is None else dataclasses.asdict(limits),
    )
