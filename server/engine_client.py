"""The server's handle on its engine process: spawn it, send requests, route deltas back.

    handler ──generate([EngineRequest…])──> AddRequest ─PUSH─> engine process
       ^                                                          │
       └── per-call asyncio.Queue <── receiver task <─PULL── StepOutput / RequestFailed

One receiver task owns the PULL socket and routes each delta by request id to the queue of the
`generate` call that owns it; a watcher task notices a dead engine process and fails every
waiting call at once, so nothing hangs, and sets `engine_died` (the server then exits). Sends use a plain (blocking) zmq socket with no
high-water mark: they never wait, which lets `generate`'s cleanup abort without awaiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from baton.engine.core.detokenizer import OutputDetokenizer
from baton.engine.core.outputs import RequestDelta
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.runtime.cpu_allocator import release_freed_memory
from baton.engine.runtime.cpu_threads import engine_environment
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
    LARGE_FRAME_BYTES,
    REFUSALS,
    REFUSED_STAT,
    SEND_ONLY,
    ReceiveLimits,
    add_request_bytes,
    limit,
)
from baton.server.args import ServerArgs
from baton.server.secret_flags import DISAGG_SECRET_ENV

logger = logging.getLogger("baton.server")

_WATCH_INTERVAL_S = 0.2
ENGINE_OUTPUTS = ReceiveLimits(
    name="server inbox", max_part_bytes=-1, max_parts=1, max_queued=10_000
)


# The context assumed for a checkpoint that declares none (a pure SSM's config may not): it only
# bounds the engine inbox's frames, which the engine's own --max-model-len check then narrows.
UNDECLARED_CONTEXT = 1 << 20


def model_max_len(model_dir: str) -> int:
    """The context the checkpoint declares (the engine's is no longer), read from its
    config.json as it stands, top level or `text_config` (a vision-language checkpoint's): the
    server builds no family config, which would import torch. A file that cannot be read is the
    engine's to report when it fails to load."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return UNDECLARED_CONTEXT
    scopes = [raw, raw.get("text_config")] if isinstance(raw, dict) else []
    for scope in scopes:
        value = scope.get("max_position_embeddings") if isinstance(scope, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return UNDECLARED_CONTEXT


class EngineUnavailable(RuntimeError):
    """The engine process is gone or the server is shutting down (HTTP 503)."""


class EngineRejected(ValueError):
    """The engine refused one request as invalid (HTTP 400)."""


class RequestFailedServerSide(RuntimeError):
    """The engine could not serve one request through no fault of the client: a disaggregated
    handover failed (peer lost, timed out, misconfigured) (HTTP 503)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    room: str  # disaggregation room ("" when colocated)
    prefill_addr: str  # decode worker: the prefill engine's transfer address


class EngineClient:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ready: EngineReady | None = None
        self.stats: dict[str, int | float] = {}
        self.unavailable_reason: str | None = "engine not started"
        # Set when the engine process exits on its own (not by shutdown): the server then
        # fails what is in flight and exits non-zero, so a supervisor restarts the pair.
        self.engine_died = asyncio.Event()
        self._routes: dict[str, tuple[asyncio.Queue, int]] = {}
        # LoRA adapters the engine serves, by name (--lora-modules, then load/unload calls)
        self.adapters: dict[str, str] = args.lora_paths() if args.enable_lora else {}
        self._adapter_calls: dict[str, asyncio.Future] = {}
        self._process: subprocess.Popen | None = None
        self._tasks: list[asyncio.Task] = []
        socket_base = os.path.join(
            tempfile.gettempdir(), f"baton-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._socket_paths = (f"{socket_base}-in", f"{socket_base}-out")
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._outbox = limit(self._sync_context.socket(zmq.PUSH), SEND_ONLY)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        # The engine's outputs: no part bound (a StepOutput grows with the step's requests, and
        # a request's first delta holds its whole prompt's logprobs), their count bounded. Its
        # only peer is the engine this server starts, over a socket file only this user opens.
        self._inbox = limit(self._async_context.socket(zmq.PULL), ENGINE_OUTPUTS)

    @property
    def alive(self) -> bool:
        return self.unavailable_reason is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def num_waiting(self) -> int:
        """Engine requests not yet running: the ones we sent minus the engine's running count."""
        return max(0, len(self._routes) - int(self.stats.get("num_running", 0)))

    async def start(self) -> EngineReady:
        """Spawn the engine process and wait until it has loaded the model."""
        input_addr, output_addr = (f"ipc://{path}" for path in self._socket_paths)
        self._outbox.bind(input_addr)
        self._inbox.bind(output_addr)
        spec = EngineProcessSpec(
            model=self.args.model,
            dtype=self.args.dtype,
            device=self.args.device,
            engine_args=self.args.engine_args(),
            input_addr=input_addr,
            output_addr=output_addr,
            max_message_bytes=add_request_bytes(
                self.args.max_model_len or model_max_len(self.args.model),
                self.args.max_request_bytes,
            ),
            parent_pid=os.getpid(),
            pair=self.args.disagg_options(),
        )
        module = "baton.engine.runtime.process" if spec.pair is None else "baton.disagg.process"
        env = engine_environment(os.environ, self.args.cpu_threads)
        if self.args.disagg_secret:  # never on a command line (server/secret_flags.py)
            env[DISAGG_SECRET_ENV] = self.args.disagg_secret
        self._process = subprocess.Popen([sys.executable, "-m", module, spec.to_json()], env=env)
        logger.info("engine process %d started", self._process.pid)
        deadline = asyncio.get_running_loop().time() + self.args.engine_start_timeout
        while not await self._inbox.poll(500):
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"engine process exited with code {self._process.returncode} while loading"
                )
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(
                    f"engine did not load within {self.args.engine_start_timeout:.0f} s"
                )
        message = decode(await self._inbox.recv())  # the engine's first message, checked below
        if isinstance(message, EngineFailed):
            raise RuntimeError(message.message)
        if not isinstance(message, EngineReady):
            raise RuntimeError(f"engine sent {type(message).__name__} before EngineReady")
        self.ready = message
        self.unavailable_reason = None
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_process()),
        ]
        return message

    async def adapter(self, action: str, name: str, path: str) -> None:
        """Load (action "load", from path) or unload a LoRA adapter in the engine; raises
        EngineRejected with the engine's reason when it refuses."""
        call_id = uuid.uuid4().hex
        done = asyncio.get_running_loop().create_future()
        self._adapter_calls[call_id] = done
        try:
            sent = self._send(AdapterCommand(call_id=call_id, action=action, name=name, path=path))
            if not sent:
                raise EngineUnavailable("engine unavailable")
            error = await asyncio.wait_for(done, timeout=self.args.engine_start_timeout)
        finally:
            self._adapter_calls.pop(call_id, None)
        if error:
            raise EngineRejected(error)
        if action == "load":
            self.adapters[name] = path
        else:
            self.adapters.pop(name, None)

    async def generate(
        self, requests: list[EngineRequest], tokenizer
    ) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Run the requests in the engine; yield (index in `requests`, delta) until all finish.

        The engine sends token ids; their text is made here, with `tokenizer` (Hugging Face),
        once per token and outside the engine process. A stop string ends a request here and
        aborts it in the engine. Closing the generator early (client gone, one request failed)
        aborts the unfinished ones in the engine. Raises EngineRejected or EngineUnavailable.
        """
        if self.unavailable_reason is not None:
            raise EngineUnavailable(self.unavailable_reason)
        queue: asyncio.Queue = asyncio.Queue()
        unfinished = {request.request_id for request in requests}
        detokenizer = OutputDetokenizer(tokenizer)
        for index, request in enumerate(requests):
            self._routes[request.request_id] = (queue, index)
            params = request.params
            detokenizer.add_request(
                request.request_id,
                request.prompt_token_ids,
                params.stop,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
            )
        try:
            for request in requests:
                message = AddRequest(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=request.params,
                    room=request.room,
                    prefill_addr=request.prefill_addr,
                )
                if not self._send(message):
                    raise EngineUnavailable("the engine process is not connected")
            while unfinished:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                delta = detokenizer.process(item)
                if delta is None:
                    continue  # a step the engine ran before our abort reached it
                if delta.finished:
                    unfinished.discard(delta.request_id)
                    if not item.finished:  # a stop string: the engine would go on
                        self._routes.pop(delta.request_id, None)
                        self._send(AbortRequests(request_ids=[delta.request_id]))
                yield index, delta
        finally:
            for request in requests:
                self._routes.pop(request.request_id, None)
            if unfinished:
                self._send(AbortRequests(request_ids=sorted(unfinished)))

    def fail_all(self, reason: str) -> None:
        """Refuse new requests and end every in-flight one with EngineUnavailable(reason)."""
        if self.unavailable_reason is None:
            self.unavailable_reason = reason
        error = EngineUnavailable(reason)
        for queue, index in self._routes.values():
            queue.put_nowait((index, error))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, ask the engine to exit, and make sure it did."""
        self.fail_all("server is shutting down")
        for task in self._tasks:
            task.cancel()
        process = self._process
        if process is not None and process.poll() is None:
            # An engine still loading reads no messages: stop it with SIGTERM instead.
            if self.ready is None or not self._send(Shutdown()):
                process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(process.wait, timeout)
            if process.poll() is None:
                logger.warning(
                    "engine process %d did not exit in %.0f s; killing it", process.pid, timeout
                )
                process.kill()
                await asyncio.to_thread(process.wait)
        self._outbox.close(linger=0)
        self._inbox.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        for path in self._socket_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _send(self, message) -> bool:
        """Queue a message for the engine without ever blocking the event loop.

        PUSH has no high-water mark here, so a send fails only when no engine is connected
        (it died, or shutdown closed the socket); then there is nobody to tell: return False.
        """
        if self._outbox.closed:
            return False
        try:
            self._outbox.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._inbox.recv_multipart()
            try:
                if len(frames) != 1:
                    raise ValueError(f"{len(frames)} parts")
                message = decode(frames[0])
            except Exception as error:  # never the engine's: one frame costs a log line at most
                REFUSALS.refuse(ENGINE_OUTPUTS.name, f"not an ipc message: {error!r}"[:200])
                size = sum(map(len, frames))
                del frames
                if size >= LARGE_FRAME_BYTES:  # and none of the memory it took stays
                    await asyncio.to_thread(release_freed_memory)
                continue
            if isinstance(message, StepOutput):
                # the engine's refused frames, and this process's (the server inbox's)
                refused = message.stats.get(REFUSED_STAT, 0) + REFUSALS.total
                self.stats = message.stats | {REFUSED_STAT: refused}
                for delta in message.deltas:
                    route = self._routes.get(delta.request_id)
                    if route is not None:
                        route[0].put_nowait((route[1], delta))
            elif isinstance(message, RequestFailed):
                route = self._routes.get(message.request_id)
                if route is not None:
                    error_class = (
                        EngineRejected if message.kind == "client" else RequestFailedServerSide
                    )
                    route[0].put_nowait((route[1], error_class(message.message)))
            elif isinstance(message, AdapterDone):
                call = self._adapter_calls.get(message.call_id)
                if call is not None and not call.done():
                    call.set_result(message.error)
            elif isinstance(message, EngineFailed):
                logger.error("engine failed: %s", message.message)
                self.fail_all(f"engine failed: {message.message}")

    async def _watch_process(self) -> None:
        assert self._process is not None
        while self._process.poll() is None:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        logger.error(
            "engine process %d exited with code %d", self._process.pid, self._process.returncode
        )
        self.fail_all(f"engine process exited with code {self._process.returncode}")
        self.engine_died.set()
