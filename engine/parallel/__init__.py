"""Tensor parallelism: who this process is among the ranks, the collectives the layers call, and
the rule by which a parameter takes its slice of a checkpoint tensor.

    rank 0 (engine process: scheduler, sampler)     rank 1 .. N-1 (engine/parallel/worker.py)
        every layer holds its shard ──── all-reduce after each row-parallel layer ────
        logits: vocab slices gathered to rank 0

A `TensorParallel` is built once per engine and handed to the model while it is constructed
(`building`, a context that refuses nesting), so each layer keeps its own and two engines of
different sizes can live in one process (the tests compare TP=2 against TP=1 side by side).
With size 1 every collective returns its input untouched: TP=1 costs one integer comparison.

The process group is a `ProcessGroupGloo` of its own over a TCP store (not torch.distributed's
global default group), with a timeout: a rank that dies or hangs makes the collective raise
instead of blocking forever. On CUDA with a GPU per rank, rank r computes on GPU r and the
layers' all-reduces run on a `ProcessGroupNCCL` beside it (vLLM keeps the same pair: a device
group for the model, a host group for control); gathers, barriers and every other host-side
exchange stay on gloo. Several ranks on one GPU (NCCL refuses a GPU twice in a communicator)
all-reduce over gloo, through host memory.

On the CPU the collectives the forward calls (the all-reduces and the logits' gather) go through
torch's functional collectives (`_c10d_functional`), operators of the dispatcher over the gloo
group registered under a name: a captured CPU step (engine/executor/cpu_plan.py) records and
replays them in C++ like any other operator, so every rank can replay its plan.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from baton.engine.config_error import ConfigError


class TensorParallel:
    """This rank's place among `size` ranks, and the collectives over their group."""

    def __init__(
        self,
        rank: int,
        size: int,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        device_group: dist.ProcessGroup | None = None,
        group_name: str | None = None,
    ):
        self.rank = rank
        self.size = size
        self.group = group
        # the name `group` is registered under for the functional collectives (None: size 1)
        self.group_name = group_name
        # NCCL over the ranks' GPUs when each rank has its own; None: all-reduces on gloo
        self.device_group = device_group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Bytes this rank handed to all-reduces (bench/offline/tp.py compares them with the analytic
        # count); an integer add per Python call: a replayed plan's collectives are not counted.
        self.all_reduce_bytes = 0
        self.all_reduce_calls = 0
        self.gather_bytes = 0  # bytes this rank handed to gathers (logits)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Drop the group's registration (the registry would keep it, and its gloo connections,
        alive after the engine stops); idempotent."""
        if self.group_name is not None:
            with contextlib.suppress(Exception):  # already gone
                torch._C._distributed_c10d._unregister_process_group(self.group_name)
            self.group_name = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place where possible); `x` itself at size 1."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self.all_reduce_bytes += x.numel() * x.element_size()
        self.all_reduce_calls += 1
        if x.device.type == "cpu" and self.group_name is not None:  # a captured step replays it
            functional = torch.ops._c10d_functional
            return functional.wait_tensor(functional.all_reduce_(x, "sum", self.group_name))
        group = self.device_group if self.device_group is not None else self.group
        group.allreduce([x]).wait(self.timeout)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `x` side by side along the last dim; other ranks: `x` unchanged
        (their result is never read: only rank 0 samples)."""
        if self.size == 1:
            return x
        # gloo gathers host tensors only: a CUDA rank's logits travel through host memory.
        host = x.contiguous().cpu()
        self.gather_bytes += host.numel() * host.element_size()
        if x.device.type == "cpu" and self.group_name is not None:  # a captured step replays it
            functional = torch.ops._c10d_functional
            # (size * rows, ..., width), rank r's rows r-th; into a tensor of its own (`out`:
            # a replay writes the recorded one, which the wait then finds)
            every = host.new_empty(self.size * host.shape[0], *host.shape[1:])
            functional.all_gather_into_tensor_out(host, self.size, self.group_name, out=every)
            functional.wait_tensor(every)
            if not self.is_first:
                return x
            return every.view(self.size, *host.shape).movedim(0, -2).flatten(-2).to(x.device)
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(host) for _ in range(self.size)]] if self.is_first else []
        self.group.gather(outputs, [host], options).wait(self.timeout)
        return torch.cat(outputs[0], dim=-1).to(x.device) if self.is_first else x

    def barrier(self, timeout_s: float) -> None:
        """All ranks reached this point, waiting up to `timeout_s` (used once, after every rank
        has loaded its shard: loading may take longer than any step)."""
        if self.size > 1:
            options = dist.AllreduceOptions()
            options.timeout = datetime.timedelta(seconds=timeout_s)
            self.group.allreduce([torch.zeros(1)], options).wait(options.timeout)


SINGLE = TensorParallel(rank=0, size=1, group=None, timeout_s=0.0)


def one_gpu_per_rank(device: str | torch.device, size: int) -> bool:
    """True when `size` > 1 ranks on CUDA each get a GPU of their own (GPUs 0..size-1)."""
    return size > 1 and torch.device(device).type == "cuda" and torch.cuda.device_count() >= size


def rank_device(device: str | torch.device, rank: int, size: int) -> torch.device:
    """The device rank `rank` computes on: GPU `rank` when every rank has its own, else
    `device` itself (the CPU, or one GPU shared by all ranks)."""
    if one_gpu_per_rank(device, size):
        return torch.device("cuda", rank)
    return torch.device(device)


def connect(
    rank: int,
    size: int,
    port: int,
    timeout_s: float,
    join_timeout_s: float,
    device: str | torch.device = "cpu",
) -> TensorParallel:
    """Join the group of `size` ranks whose rank 0 hosts the TCP store on 127.0.0.1:`port`,
    waiting up to `join_timeout_s` for the others; collectives then time out after
    `timeout_s`. With a GPU per rank (`one_gpu_per_rank`), the all-reduces run on NCCL."""
    if size == 1:
        return SINGLE
    store = dist.TCPStore(
        "127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=join_timeout_s)
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    # The functional collectives find the group by this name; the port is this group's alone
    # in this process (several engines of a test process each have their own).
    name = f"baton-tp-{port}"
    registered = torch._C._distributed_c10d
    with contextlib.suppress(Exception):  # a name left by an earlier group on the same port
        registered._unregister_process_group(name)
    registered._register_process_group(name, group)
    device_group = None
    if one_gpu_per_rank(device, size):
        torch.cuda.set_device(rank)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    return TensorParallel(rank, size, group, timeout_s, device_group, group_name=name)


_building: list[TensorParallel] = []


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """The layers constructed inside take their shard of `tp` (see `current`)."""
    if _building:
        raise RuntimeError("a model is already being built for tensor parallelism")
    _building.append(tp)
    try:
        yield
    finally:
        _building.pop()


def current() -> TensorParallel:
    """The TensorParallel of the model under construction; TP=1 outside `building`."""
    return _building[-1] if _building else SINGLE


# -- what each rank holds ------------------------------------------------------------------


def split_evenly(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal part of `total` items; ConfigError if uneven."""
    if total % tp.size:
        raise ConfigError(f"{what}={total} is not divisible by the tensor-parallel size {tp.size}")
    part = total // tp.size
    return tp.rank * part, part


def padded_part(total: int, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's part of `total` rows cut in `size` parts of equal,
    rounded-up length (the vocabulary: the last part may run past `total`, padded with zeros)."""
    part = -(-total // tp.size)
    return tp.rank * part, part


def kv_head_part(num_kv_heads: int, num_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, count) of this rank. With fewer KV heads than ranks each KV head is
    replicated on size / num_kv_heads ranks: the one its query heads attend with."""
    if num_kv_heads >= tp.size:
        return split_evenly(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ConfigError(
            f"num_key_value_heads={num_kv_heads} must divide the tensor-parallel size {tp.size} "
            f"when it is smaller"
        )
    first_q, _ = split_evenly(num_heads, tp, "num_attention_heads")
    return first_q // (num_heads // num_kv_heads), 1


def mamba_group_part(n_groups: int, tp: TensorParallel) -> tuple[int, int]:
    """(first group, count) of this rank: groups split when divisible, all replicated when
    there is one (the gated norm then spans the ranks); any other pair cannot be served."""
    if n_groups == 1:
        return 0, 1
    if n_groups % tp.size:
        raise ConfigError(
            f"n_groups={n_groups} cannot be served with tensor-parallel size {tp.size}: "
            f"n_groups must be 1 or divisible by it"
        )
    return split_evenly(n_groups, tp, "n_groups")


# -- how a parameter takes its slice of a checkpoint tensor --------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Slices:
    """This rank's parameter = the checkpoint tensor's `ranges` (start, length) along `dim`,
    concatenated in order; a range past the tensor's end is padded with zeros (vocab)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        return self.read(full, tuple(full.shape))

    def read(self, source, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's slice of `source`, a tensor or anything indexed like one (a safetensors
        slice: only the bytes of the slice are read from the file) of the given full shape."""
        dim = self.dim % len(shape)
        parts = []
        for start, length in self.ranges:
            have = max(0, min(length, shape[dim] - start))
            if have:
                index = [slice(None)] * len(shape)
                index[dim] = slice(start, start + have)
                parts.append(source[tuple(index)])
            if have < length:
                padding = list(shape)
                padding[dim] = length - have
                parts.append(torch.zeros(padding, dtype=parts[0].dtype if parts else None))
        return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstRankOnly:
    """A row-parallel layer's bias: rank 0 adds it, the others hold zeros, so the all-reduce
    sums it exactly once."""

    rank: int

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.rank == 0 else torch.zeros_like(full)


ShardRule = Slices | FirstRankOnly


def shard(param: torch.Tensor | None, rule: ShardRule) -> None:
    """Attach the rule the loader applies to this parameter's checkpoint tensor."""
    if param is not None:
        param.tp_shard = rule


def shard_rule(param: torch.Tensor) -> ShardRule | None:
    return getattr(param, "tp_shard", None)
