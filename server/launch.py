"""Run one colocated worker: engine process + HTTP server, and wind both down on a signal.

start:    spawn engine ─> wait EngineReady ─> bind HTTP ─> serve
SIGTERM/SIGINT while serving: refuse new work and fail in-flight requests (their engine
          requests are aborted), uvicorn closes its sockets, the engine gets Shutdown and
          exits; a stubborn engine is killed. Before serving, a signal cancels startup.
engine process dies while serving: its in-flight requests have already failed (error event,
          then [DONE]); uvicorn winds down the same way and `serve` raises EngineDied, so the
          server exits non-zero and a supervisor (docker's restart policy, systemd,
          Kubernetes, `baton up`) sees it, instead of a live port answering 503 forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from baton.engine.models.registry import architecture_for
from baton.engine.runtime.gc_freeze import freeze_startup_objects
from baton.server.args import HTTP_PROTOCOL, SERVER_KEEP_ALIVE_S, ServerArgs
from baton.server.engine_client import EngineClient

if TYPE_CHECKING:
    from baton.server.tokenizer import Tokenizer

logger = logging.getLogger("baton.server")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# `baton serve` exits with this code when its engine died under it (1: any other failure), so
# a supervisor's log, and `baton up`, can tell which of the two processes failed first.
ENGINE_DIED_EXIT_CODE = 3


class EngineDied(RuntimeError):
    """The engine process exited while the server was serving (the server exits non-zero)."""


class _Server(uvicorn.Server):
    """uvicorn's server, which also fails in-flight requests as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, client: EngineClient) -> None:
        super().__init__(config)
        self.client = client
        self.loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: hand the work to the event loop instead of doing it here.
        self.loop.call_soon_threadsafe(self.client.fail_all, "server is shutting down")
        super().handle_exit(sig, frame)


def check_model_config(model_dir: str) -> None:
    """config.json names a family baton serves, checked before any process starts, without
    importing the family (it brings torch, which the server never needs). The family's own
    reading of the file (a missing or unusable key) is the engine's: it names the key when it
    fails to load."""
    path = Path(model_dir) / "config.json"
    try:
        architecture_for(json.loads(path.read_text()), str(path))
    except (ValueError, OSError) as error:
        raise RuntimeError(f"failed to load model {model_dir}: {error}") from error


def prepare_http_side(args: ServerArgs) -> Tokenizer:
    """The tokenizer, and the imports serving needs, made while the engine loads (in a thread,
    after the engine process is spawned): fastapi, pydantic and transformers take ~1 s of an
    idle 2-core machine that the engine's start would otherwise wait for."""
    import baton.server.app  # noqa: F401
    from baton.server.tokenizer import load_tokenizer

    flag = "--tokenizer" if args.tokenizer else "--model"
    return load_tokenizer(args.tokenizer_dir, flag, args.chat_template_text())


async def serve(args: ServerArgs) -> None:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, main_task.cancel)
    client = EngineClient(args)
    try:
        await asyncio.to_thread(check_model_config, args.model)
        # The engine loads while this process imports its HTTP side and loads the tokenizer; a
        # tokenizer that cannot load stops both.
        starting = asyncio.ensure_future(client.start())
        await asyncio.sleep(0)  # start() spawns the engine process before it first waits
        try:
            tokenizer = await asyncio.to_thread(prepare_http_side, args)
        except BaseException:
            starting.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await starting
            raise
        ready = await starting
        logger.info(
            "engine ready: vocab %d, max-model-len %d", ready.vocab_size, ready.max_model_len
        )
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
            # uvicorn restores these handlers after serving and re-raises the signal it caught;
            # ignoring it then lets the engine shut down below instead of killing us first.
            signal.signal(sig, signal.SIG_IGN)
        from baton.server.app import build_app  # imported by prepare_http_side: no cost here
        from baton.server.metrics import ServerMetrics
        from baton.server.openai.generation import ServerState

        state = ServerState(
            args=args,
            client=client,
            tokenizer=tokenizer,
            metrics=ServerMetrics(lambda: client.stats),
        )
        config = uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
            http=HTTP_PROTOCOL,
        )
        server = _Server(config, client)
        freeze_startup_objects()
        serving = asyncio.ensure_future(server.serve())
        died = asyncio.ensure_future(client.engine_died.wait())
        await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
        engine_died = died.done() and not server.should_exit  # not while a signal stops us
        died.cancel()
        if engine_died:
            logger.error("the engine process died; stopping the server (exit code 1)")
            server.should_exit = True
        await serving
        if engine_died:
            raise EngineDied(
                f"{client.unavailable_reason}; exiting so that a supervisor can restart the server"
            )
    finally:
        await client.shutdown()


def run(args: ServerArgs) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        asyncio.run(serve(args))
    except asyncio.CancelledError:
        logger.info("interrupted while starting; engine stopped")
