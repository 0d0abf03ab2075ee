"""NIXL as the transfer backend (`--disaggregation-transfer-backend nixl`): the decode engine
READs a prefill's state straight from the prefill engine's pools into its own, as vLLM's
NixlConnector does; ZMQ stays the authenticated control channel.

    prefill                                          decode
    pools registered with its agent at start         pools registered with its agent at start
                        <── Register (Compat says "nixl" on both sides) ──
    prefill done: pages + slot held (Request.hold)
                        ── ReadOffer: agent metadata, pool regions, page / slot /
                           checkpoint indices, first token ──>
                                                     metadata loaded (this peer's only), every
                                                     index and region checked, descriptors
                                                     derived from the state spec, one READ
                                                     ... done (or failed / past the deadline:
                                                     cancelled, the room fails)
                        <── ReadDone (or Abort) ──
    hold released: pages and slot go back           first token installed, decoding starts

What travels is the state spec's (HandoverLayout): every paged tensor's pages, every slot
tensor's slot, every checkpointed tensor's checkpoint slots, each (layer, run of rows) one
descriptor pair. Nothing here names a mixer. The offer carries indices, never raw addresses: the
decode side computes every address from the regions the prefill engine registered, after
checking the regions against its own layout and each index against its region, and NIXL checks
once more that each lies in memory the prefill agent registered.

NIXL's agent metadata is deserialized by the library (not safe for an untrusted peer): it is
only read from a ReadOffer, which passed the channel's HMAC, from the prefill worker the room
names, under an agent name no other peer has. UCX's addresses bind where baton's transfer
address does: on a loopback host UCX_NET_DEVICES defaults to `lo` (UCX_TLS, UCX_NET_DEVICES and
the RDMA devices are the operator's to set otherwise: README, "Transfer backends").
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import torch

from baton.disagg.messages import PoolRegion
from baton.disagg.rooms import is_loopback
from baton.disagg.schema import MAX_INT
from baton.engine.handover.state import HandoverLayout, StatePlace

logger = logging.getLogger("baton.disagg.nixl")

TransferBackend = Literal["zmq", "nixl"]
TRANSFER_BACKENDS: tuple[TransferBackend, ...] = ("zmq", "nixl")

MEMORY_KINDS = ("DRAM", "VRAM")
PROGRESS_DELAY_US = 1000  # between the passes of a prefill agent's progress thread

# (address, bytes, device id): one side of a NIXL transfer descriptor
Descriptor = tuple[int, int, int]


def load_nixl() -> Any:
    """NIXL's Python API (the registry's `nixl-cu12` wheel, which bundles UCX); RuntimeError
    saying how to install it when it is missing."""
    try:
        import nixl_cu12 as nixl
    except ImportError:
        try:
            from nixl import _api as nixl
        except ImportError:
            raise RuntimeError(
                "--disaggregation-transfer-backend nixl needs NIXL: pip install 'baton[nixl]'"
                " (the nixl-cu12 wheel, which bundles UCX)"
            ) from None
    return nixl


def nixl_available() -> bool:
    try:
        load_nixl()
    except RuntimeError:
        return False
    return True


def paced_agent(nixl: Any, name: str) -> Any:
    """An agent with the UCX backend whose progress thread waits PROGRESS_DELAY_US between
    passes. NIXL's Python API starts it with no delay: it spins, ~0.7 of a core while idle on
    this 2-core machine, per process (every prefill rank has one). The C++ config it wraps takes
    the delay, and the thread still wakes on its worker's events: a 16 MiB READ over TCP on
    loopback took ~15 ms paced at 1 ms, 45-100 ms spinning (the spinner competes with the
    reader), idle cost ~2% of a core. Built through the same bindings the Python API uses;
    where they are not as this version has them, its own (spinning) agent."""
    bind = getattr(importlib.import_module(nixl.nixl_agent.__module__), "nixlBind", None)
    if bind is None or not hasattr(bind, "nixlAgentConfig"):
        return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
    shell = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = bind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value  # (as the API's)
    config.pthrDelay = PROGRESS_DELAY_US
    config.captureTelemetry = False
    shell.agent = bind.nixlAgent(name, config)
    shell.create_backend("UCX", {})
    return shell


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadPlan:
    """One READ: local[i] receives remote[i] (same length), for every tensor of the spec."""

    local: list[Descriptor]
    remote: list[Descriptor]
    local_memory: str
    remote_memory: str
    bytes: int


def region_of(name: str, pool: torch.Tensor) -> PoolRegion:
    """How a pool tensor (layers, rows, *one row's shape), contiguous, is registered."""
    if not pool.is_contiguous():
        raise ValueError(f"pool {name} is not contiguous: it cannot be registered as one region")
    on_gpu = pool.device.type == "cuda"
    return PoolRegion(
        name=name,
        address=pool.data_ptr(),
        layers=pool.shape[0],
        rows=pool.shape[1],
        row_bytes=pool[0, 0].numel() * pool.element_size() if pool.numel() else 0,
        memory="VRAM" if on_gpu else "DRAM",
        device=pool.device.index or 0 if on_gpu else 0,
    )


def check_regions(layout: HandoverLayout, regions: list[PoolRegion]) -> dict[str, PoolRegion]:
    """A TP=1 peer's pool regions by name, each checked against this TP=1 engine's layout (the
    same tensors, layers and row sizes: Compat proved the whole model's shapes match);
    ValueError naming the first that does not fit."""
    return check_pool_regions(
        {t.name: (t.layers, t.bytes) for t in layout.tensors}, regions, "the prefill worker"
    )


def check_pool_regions(
    expected: dict[str, tuple[int, int]], regions: list[PoolRegion], whose: str
) -> dict[str, PoolRegion]:
    """`whose` pool regions by name, each checked against `expected` (pool name -> (layers, row
    bytes) that peer must have: its own rank's rows); ValueError naming the first that does
    not fit."""
    by_name = {r.name: r for r in regions}
    if len(by_name) != len(regions) or set(by_name) != set(expected):
        raise ValueError(
            f"{whose} offers pools {sorted(r.name for r in regions)}, this model keeps"
            f" {sorted(expected)}"
        )
    memory = {r.memory for r in regions}
    if not memory <= set(MEMORY_KINDS) or len(memory) > 1:
        raise ValueError(f"{whose}'s pools are in memory {sorted(memory)}")
    for name, (layers, row_bytes) in expected.items():
        r = by_name[name]
        size = r.layers * r.rows * r.row_bytes
        if r.layers != layers or r.row_bytes != row_bytes or r.rows < 2:
            raise ValueError(
                f"pool {name} of {whose}: {r.layers} layers of {r.rows} rows of"
                f" {r.row_bytes} bytes, expected {layers} layers of rows of {row_bytes} bytes"
                " (and a dummy row)"
            )
        if not 0 < r.address <= MAX_INT - size:
            raise ValueError(f"pool {name} of {whose} lies outside any address space")
    return by_name


def index_in(kind: str, index: int, rows: int, pool: str) -> None:
    """Row 0 (page 0, slot 0) is the pool's dummy: a live request never has it."""
    if not 1 <= index < rows:
        raise ValueError(
            f"the prefill worker offers {kind} {index} of pool {pool}, which has {kind}s 1..{rows - 1}"
        )


def plan_read(
    layout: HandoverLayout,
    local_regions: dict[str, PoolRegion],
    remote_regions: dict[str, PoolRegion],
    remote: StatePlace,
    local: StatePlace,
) -> ReadPlan:
    """The descriptors of one room's READ: every paged tensor's pages (runs of consecutive pages
    on both sides merged), every slot tensor's slot, every checkpointed tensor's checkpoint
    slots (blocks cached here already, 0 in `local`, are skipped; blocks past the last local
    checkpoint slot too). Every remote index is checked against its region first; ValueError
    naming the first that is out of range or a count that does not match."""
    if len(remote.pages) != len(local.pages):
        raise ValueError(
            f"the prefill worker offers {len(remote.pages)} pages, this request needs"
            f" {len(local.pages)}"
        )
    if len(remote.checkpoint_slots) < len(local.checkpoint_slots):
        raise ValueError(
            f"the prefill worker offers {len(remote.checkpoint_slots)} block checkpoints,"
            f" {len(local.checkpoint_slots)} were reserved for them"
        )
    ps = layout.page_size
    local_d: list[Descriptor] = []
    remote_d: list[Descriptor] = []

    def add(name: str, layer: int, local_row: int, remote_row: int, rows: int) -> None:
        lr, rr = local_regions[name], remote_regions[name]
        local_d.append(
            (
                lr.address + (layer * lr.rows + local_row) * lr.row_bytes,
                rows * lr.row_bytes,
                lr.device,
            )
        )
        remote_d.append(
            (
                rr.address + (layer * rr.rows + remote_row) * rr.row_bytes,
                rows * rr.row_bytes,
                rr.device,
            )
        )

    for t in layout.tensors:
        rows = remote_regions[t.name].rows
        if t.kind == "paged":
            for p in remote.pages:
                index_in("page", p, rows // ps, t.name)
            runs = runs_of(local.pages, remote.pages)
            for layer in range(t.layers):
                for local_page, remote_page, n in runs:
                    add(t.name, layer, local_page * ps, remote_page * ps, n * ps)
            continue
        index_in("slot", remote.slot, rows, t.name)
        for layer in range(t.layers):
            add(t.name, layer, local.slot, remote.slot, 1)
        if not t.checkpointed:
            continue
        for local_slot, remote_slot in zip(local.checkpoint_slots, remote.checkpoint_slots):
            index_in("checkpoint slot", remote_slot, rows, t.name)
            if local_slot:
                for layer in range(t.layers):
                    add(t.name, layer, local_slot, remote_slot, 1)
    memory = {r.memory for r in local_regions.values()} or {"DRAM"}
    remote_memory = {r.memory for r in remote_regions.values()} or {"DRAM"}
    return ReadPlan(
        local=local_d,
        remote=remote_d,
        local_memory=memory.pop(),
        remote_memory=remote_memory.pop(),
        bytes=sum(n for _, n, _ in local_d),
    )


def runs_of(local: tuple[int, ...], remote: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(local first, remote first, length) of the runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


class NixlAgent:
    """This engine's NIXL agent (UCX backend), its pools registered once at start; on the
    decode side also the prefill agents it has loaded (by transfer address) and its READs."""

    def __init__(self, role: str, host: str, pools: dict[str, torch.Tensor]) -> None:
        nixl = load_nixl()
        if is_loopback(host):
            # UCX listens on every interface unless told: on a loopback pair, only on lo (as
            # baton's transfer socket does). An operator's own setting wins.
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.name = f"baton-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        # The side that is read needs its UCX worker progressed while its engine computes (over
        # TCP a READ is served by the target; shared memory and RDMA need nothing of it): NIXL's
        # progress thread, paced (`paced_agent`). The reading side progresses its own READs as
        # it polls them, and runs none.
        if role == "prefill":
            self.agent = paced_agent(nixl, self.name)
        else:
            config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.agent = nixl.nixl_agent(self.name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(
                "NIXL could not create its UCX backend (check UCX_TLS: tcp,self or sm,tcp,self"
                " work on one host; shm,self alone does not)"
            )
        # The pools given share no memory (StateCache.moved_pools leaves out a sliding-window
        # pool inside a full-attention one, ModelStateSpec.covered_pools): UCX does not take
        # two registrations of one range.
        registered = [t for t in pools.values() if t.numel()]
        self.registration = self.agent.register_memory(registered) if registered else None
        self.regions = [region_of(name, t) for name, t in pools.items() if t.numel()]
        self.region_by_name = {r.name: r for r in self.regions}
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.peers: dict[str, tuple[str, bytes]] = {}  # transfer address -> (agent, metadata)

    # -- decode side ----------------------------------------------------------------------------

    def load_peer(self, address: str, agent: str, metadata: bytes) -> str:
        """The prefill agent of the worker at `address`, its metadata loaded once (again when it
        changed: a restarted worker). ValueError for a name that is this agent's or another
        peer's, or metadata that names another agent than the offer says."""
        known = self.peers.get(address)
        if known == (agent, metadata):
            return agent
        owner = next((a for a, (n, _) in self.peers.items() if n == agent and a != address), None)
        if agent == self.name or owner is not None:
            raise ValueError(
                f"the prefill worker's NIXL agent {agent!r} is already"
                f" {'this worker' if owner is None else f'the agent of {owner}'}"
            )
        if known is not None:
            self.forget_peer(address)
        loaded = self.agent.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != agent:
            self.agent.remove_remote_agent(loaded)
            raise ValueError(
                f"the prefill worker's NIXL metadata is of agent {loaded!r}, not {agent!r}"
            )
        self.peers[address] = (agent, metadata)
        return agent

    def forget_peer(self, address: str) -> None:
        known = self.peers.pop(address, None)
        if known is not None:
            try:
                self.agent.remove_remote_agent(known[0])
            except Exception as error:  # a peer already gone: nothing left to forget
                logger.debug("forgetting NIXL agent %s: %s", known[0], error)

    def start_read(self, agent: str, plan: ReadPlan) -> Any:
        """Post the READ of `plan` from `agent`'s pools into this agent's; its handle (None when
        there is nothing to read). RuntimeError when NIXL refuses it."""
        if not plan.local:
            return None
        try:
            local = self.agent.get_xfer_descs(plan.local, plan.local_memory)
            remote = self.agent.get_xfer_descs(plan.remote, plan.remote_memory)
            handle = self.agent.initialize_xfer("READ", local, remote, agent)
            state = self.agent.transfer(handle)
        except Exception as error:  # NIXL's own checks: memory not registered by the peer, ...
            raise RuntimeError(f"NIXL refused the read: {error}") from None
        if state == "ERR":
            self.release(handle)
            raise RuntimeError("NIXL could not post the read")
        return handle

    def state(self, handle: Any) -> str:
        """ "DONE", "PROC" or "ERR" (a failed check counts as an error)."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as error:
            logger.warning("NIXL read state: %s", error)
            return "ERR"

    def release(self, handle: Any) -> None:
        """Release a READ's handle; one still in flight is cancelled (its destination is not
        written once this returns)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as error:
            logger.warning("releasing a NIXL read: %s", error)

    def close(self) -> None:
        """Forget the peers, deregister the pools and let the agent go (its progress thread
        stops with it)."""
        if self.agent is None:
            return
        for address in list(self.peers):
            self.forget_peer(address)
        if self.registration is not None:
            try:
                self.agent.deregister_memory(self.registration)
            except Exception as error:
                logger.debug("deregistering the pools: %s", error)
            self.registration = None
        self.agent = None
