"""The engine process: owns one `Engine` and steps it while there is work.

    server ──AddRequest/AbortRequests/Shutdown──> [inbox PULL]  EngineLoop  [outbox PUSH] ──> server
                                                                  │  StepOutput after every step
                                                                  └─ engine.step() while busy

Started by the server as `python -m baton.engine.runtime.process SPEC_JSON`. It exits on `Shutdown`, when
its parent dies (PR_SET_PDEATHSIG plus a parent-pid check, so no orphan outlives the server;
it then removes the server's ipc socket files, which a server killed outright leaves behind),
or after an internal error, which it reports as `EngineFailed` first. SIGINT is ignored: a
Ctrl-C reaches the whole process group and the server decides how to wind down.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from dataclasses import asdict

import zmq

from baton.engine.core.engine import Engine
from baton.engine.runtime.cpu_allocator import release_freed_memory
from baton.engine.runtime.gc_freeze import freeze_startup_objects
from baton.engine.runtime.ipc import (
    AbortRequests,
    AdapterCommand,
    AdapterDone,
    AddRequest,
    EngineFailed,
    EngineProcessSpec,
    EngineReady,
    RequestFailed,
    Shutdown,
    StepOutput,
    decode,
    encode,
)
from baton.engine.runtime.socket_limits import (
    REFUSALS,
    REFUSED_STAT,
    SEND_ONLY,
    ipc_limits,
    limit,
    receive,
)

logger = logging.getLogger("baton.engine")

IDLE_POLL_MS = 100  # how long an idle engine waits for work before checking on its parent
_PR_SET_PDEATHSIG = 1


class EngineLoop:
    """Receive messages, step the engine while it has work, send what each step produced."""

    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.engine = engine
        self.inbox = inbox
        self.inbox_limits = ipc_limits("engine inbox", inbox.getsockopt(zmq.MAXMSGSIZE))
        self.outbox = outbox
        self.parent_pid = parent_pid
        # A dead tensor-parallel rank fails the engine even while it idles (so /health turns
        # unhealthy before a request finds out); wrapped engines (disagg workers) run at TP=1.
        self.check_ranks = getattr(engine, "check_ranks", lambda: None)
        self.busy = False

    def _went_idle(self) -> None:
        """The last request just finished: hand the steps' freed temporaries back to the system.
        While busy the heap keeps them for the next step (cpu_allocator: that saves the page
        faults); idle, they would be held for nothing (a burst of long prompts left ~300 MB of
        a 110M model's engine resident until the next burst). Once per busy -> idle change."""
        release_freed_memory()

    def run(self) -> int:
        """Return the process exit code: 0 after Shutdown or parent death, 1 after a failure."""
        while True:
            if os.getppid() != self.parent_pid:
                logger.warning("parent process %d is gone; engine exiting", self.parent_pid)
                return 0
            handled = 0
            if self._wait_for_messages():
                handled, shutdown = self._drain_inbox()
                if shutdown:
                    return 0
            try:
                self.check_ranks()
                if self.engine.has_unfinished_requests():
                    self.busy = True
                    self._send(StepOutput(deltas=self.engine.step(), stats=self._stats()))
                    self._send_refused()
                    self._after_step()
                elif handled:
                    self._send(StepOutput(deltas=[], stats=self._stats()))
                if self.busy and not self.engine.has_unfinished_requests():
                    self.busy = False
                    self._went_idle()
            except Exception as error:
                logger.exception("engine step failed")
                self._send(EngineFailed(message=f"engine step failed: {error!r}"))
                return 1

    def _wait_for_messages(self) -> bool:
        """Whether the server sent something; waits only while the engine has nothing to do."""
        return bool(self.inbox.poll(0 if self.engine.has_unfinished_requests() else IDLE_POLL_MS))

    def _after_step(self) -> None:
        """Hook for wrapped engines (disaggregation reports failed rooms here)."""

    def _send_refused(self) -> None:
        """Requests whose grammar proved unusable once compiled (structured outputs; the engine
        has ended them) fail as the client's. A disaggregated room is left to the router, which
        cancels the other half when one fails: failing it here would race that half to the
        client with a transfer error (503) for what is a bad request (400)."""
        for request_id, reason in self.engine.take_refused():
            self._send(RequestFailed(request_id=request_id, message=reason, kind="client"))

    def _drain_inbox(self) -> tuple[int, bool]:
        """Handle every queued message; return how many, and whether Shutdown was among them."""
        handled = 0
        while True:
            try:
                frames = receive(self.inbox, self.inbox_limits)
            except zmq.Again:
                return handled, False
            if frames is None:
                continue
            try:
                message = decode(frames[0])
            except Exception as error:  # msgpack's and the messages' own errors
                REFUSALS.refuse(self.inbox_limits.name, f"not an ipc message: {error!r}"[:200])
                continue
            handled += 1
            if isinstance(message, Shutdown):
                return handled, True
            if isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.engine.abort_request(request_id)
            elif isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AdapterCommand):
                self._adapter(message)
            else:
                logger.error("engine ignores unexpected message %s", type(message).__name__)

    def _add(self, message: AddRequest) -> None:
        if message.room:
            self._send(
                RequestFailed(
                    request_id=message.request_id,
                    message="this worker is not part of a disaggregated pair (no --disaggregation-mode)",
                    kind="server",
                )
            )
            return
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params)
        except ValueError as error:
            self._send(
                RequestFailed(request_id=message.request_id, message=str(error), kind="client")
            )

    def _adapter(self, message: AdapterCommand) -> None:
        """Load or unload a LoRA adapter between steps; a refusal is the caller's answer."""
        error = ""
        method = getattr(
            self.engine, "add_lora" if message.action == "load" else "remove_lora", None
        )
        try:
            if method is None:
                raise ValueError("this worker does not load adapters at run time")
            method(*((message.name, message.path) if message.action == "load" else (message.name,)))
        except (ValueError, OSError) as refused:
            error = str(refused)
        except Exception as failed:  # never the engine's end: the adapter is refused
            logger.exception("adapter %s %r failed", message.action, message.name)
            error = f"adapter {message.name!r}: {message.action} failed: {failed!r}"
        self._send(AdapterDone(call_id=message.call_id, error=error))

    def _stats(self) -> dict[str, int | float]:
        # request timing histograms when the engine keeps them (wrapped disagg engines do not)
        timing = getattr(self.engine, "timing_stats", dict)()
        tiers = getattr(self.engine, "tier_stats", dict)()  # (wrapped disagg engines: extra_stats)
        refused = {REFUSED_STAT: REFUSALS.total}
        return asdict(self.engine.stats()) | timing | tiers | refused

    def _send(self, message) -> None:
        self.outbox.send(encode(message))


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def main(argv: list[str] | None = None, load_and_run=None) -> int:
    """Process setup shared by every engine process; `load_and_run` builds what runs inside
    (baton.disagg.process passes one that wraps the engine in a prefill or decode worker)."""
    load_and_run = load_and_run or _load_and_run
    argv = sys.argv[1:] if argv is None else argv
    spec = EngineProcessSpec.from_json(argv[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def exit_on_sigterm(*_) -> None:  # PR_SET_PDEATHSIG's (or a supervisor's)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: no second cuts this short
        _remove_orphaned_ipc_files(spec, wait_s=1.0)
        sys.exit(0)  # through the `finally` below

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    _die_with_parent()
    context = zmq.Context()
    inbox = limit(context.socket(zmq.PULL), ipc_limits("engine inbox", spec.max_message_bytes))
    inbox.connect(spec.input_addr)
    outbox = limit(context.socket(zmq.PUSH), SEND_ONLY)
    outbox.connect(spec.output_addr)
    try:
        return load_and_run(spec, inbox, outbox)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a late one must not cut this short
        _remove_orphaned_ipc_files(spec)
        inbox.close(linger=0)
        outbox.close(linger=1000)  # let the last message (EngineFailed, say) reach the server
        context.term()


def _remove_orphaned_ipc_files(spec: EngineProcessSpec, wait_s: float = 0.0) -> None:
    """A server killed outright (kill -9) leaves its ipc socket files behind: once it is gone,
    the engine it started removes them. `wait_s`: how long the server may take to be gone
    (PR_SET_PDEATHSIG fires when the server's thread that started us dies, a moment before the
    process is gone and we are handed to a new parent); still there after it, it is alive and
    removes its own."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == spec.parent_pid:
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)
    for address in (spec.input_addr, spec.output_addr):
        if address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(address.removeprefix("ipc://"))


def _load_and_run(spec: EngineProcessSpec, inbox: zmq.Socket, outbox: zmq.Socket) -> int:
    engine = None
    try:
        engine = Engine(spec.model, dtype=spec.dtype, device=spec.device, **spec.engine_args)
        engine.warm_up()  # the first request's one-time costs, paid before ready
    except Exception as error:
        logger.exception("failed to load %s", spec.model)
        if engine is not None:
            engine.close()
        outbox.send(encode(EngineFailed(message=f"failed to load model {spec.model}: {error}")))
        return 1
    config = engine.model_config
    outbox.send(
        encode(
            EngineReady(
                vocab_size=config.vocab_size,
                max_model_len=engine.max_model_len,
                transfer_addr="",
                rank_transfer_addrs=[],
                page_size=engine.args.page_size,
                track_interval=engine.handover.track_interval,
            )
        )
    )
    freeze_startup_objects()  # the model and everything loaded with it
    try:
        return EngineLoop(engine, inbox, outbox, spec.parent_pid).run()
    finally:
        engine.close()  # the tensor-parallel ranks, if any


if __name__ == "__main__":
    sys.exit(main())
