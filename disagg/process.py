"""The engine process of a disaggregated worker: `python -m baton.disagg.process SPEC_JSON`.

The same loop as the colocated engine process (baton.engine.runtime.process.EngineLoop), around a
PrefillWorker or DecodeWorker instead of a bare Engine: it also waits on the transfer sockets,
reports failed rooms to the server as RequestFailed, and adds transfer counters to the stats.
"""

from __future__ import annotations

import logging
import os
import sys

import zmq

from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.rooms import DisaggConfig
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.disagg.worker import DisaggWorker
from baton.engine.core.engine import Engine
from baton.engine.runtime import process as engine_process
from baton.engine.runtime.gc_freeze import freeze_startup_objects
from baton.engine.runtime.ipc import (
    AddRequest,
    EngineFailed,
    EngineReady,
    RequestFailed,
    StepOutput,
    encode,
)

logger = logging.getLogger("baton.disagg")

PEER_POLL_MS = 10  # while rooms wait on the other side: heartbeats and timeouts need steps
READ_POLL_MS = 1  # while READs are in flight: each ms of noticing one late is a ms of TTFT


class DisaggEngineLoop(engine_process.EngineLoop):
    def _wait_for_messages(self) -> bool:
        worker = self.engine
        if worker.computing():
            return bool(self.inbox.poll(0))
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        for socket in worker.sockets():
            poller.register(socket, zmq.POLLIN)
        waiting_on_peers = worker.has_unfinished_requests()
        timeout = PEER_POLL_MS if waiting_on_peers else engine_process.IDLE_POLL_MS
        if worker.reading():
            timeout = READ_POLL_MS
        events = dict(poller.poll(timeout))
        peer_messages = len(events) > (self.inbox in events)
        if peer_messages:
            worker.poll()  # peer messages are handled even while no request runs here
        # Rooms expire on this timer too: peers that register and never follow up cost nothing
        # for long even while no request runs here.
        if worker.expire_idle() or peer_messages:
            self._after_step()  # a Reject, Abort or expiry may have failed a request just now ...
            self._send(StepOutput(deltas=[], stats=self._stats()))  # ... and freed its pages
        return self.inbox in events

    def _add(self, message: AddRequest) -> None:
        worker: DisaggWorker = self.engine
        try:
            worker.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                room=message.room,
                prefill_addr=message.prefill_addr,
            )
        except ValueError as error:  # the request itself (its prompt, its handover address)
            self._send(
                RequestFailed(request_id=message.request_id, message=str(error), kind="client")
            )
        except Exception as error:  # no request may take the engine down
            logger.exception("request %s could not be added", message.request_id)
            self._send(
                RequestFailed(
                    request_id=message.request_id,
                    message=f"the worker could not start this request: {error!r}",
                    kind="server",
                )
            )

    def _after_step(self) -> None:
        for request_id, reason in self.engine.take_failures():
            self._send(
                RequestFailed(
                    request_id=request_id,
                    message=f"disaggregated transfer failed: {reason}",
                    kind="server",
                )
            )

    def _stats(self) -> dict[str, int | float]:
        extra = {k: v for k, v in self.engine.extra_stats().items() if isinstance(v, (int, float))}
        return super()._stats() | extra


def load_and_run(
    spec: engine_process.EngineProcessSpec, inbox: zmq.Socket, outbox: zmq.Socket
) -> int:
    options = dict(spec.pair or {})
    secret = os.environ.get(SECRET_ENV) or None  # the server's, in our environment
    config = DisaggConfig(secret=secret.encode() if secret else None, **options)
    try:
        engine = Engine(
            spec.model,
            dtype=spec.dtype,
            device=spec.device,
            handover_connector=connector_spec(config.role, config.host, config.transfer_backend),
            **spec.engine_args,
        )
        engine.warm_up()  # the first request's one-time costs, paid before ready
        context = zmq.Context.instance()
        worker_class = PrefillWorker if config.role == "prefill" else DecodeWorker
        worker: DisaggWorker = worker_class(engine, config, context)
    except Exception as error:
        logger.exception("failed to start the %s worker for %s", spec.pair, spec.model)
        outbox.send(encode(EngineFailed(message=f"failed to start disaggregated worker: {error}")))
        return 1
    transfer_addr = worker.transfer_address
    if transfer_addr:
        logger.info("prefill transfer socket listening at %s", transfer_addr)
    outbox.send(
        encode(
            EngineReady(
                vocab_size=engine.model_config.vocab_size,
                max_model_len=engine.max_model_len,
                transfer_addr=transfer_addr,
                rank_transfer_addrs=list(engine.handover.shards.addresses),
                page_size=engine.args.page_size,
                track_interval=engine.handover.track_interval,
            )
        )
    )
    freeze_startup_objects()  # the model and everything loaded with it
    try:
        return DisaggEngineLoop(worker, inbox, outbox, spec.parent_pid).run()
    finally:
        worker.close()


def main(argv: list[str] | None = None) -> int:
    return engine_process.main(argv, load_and_run=load_and_run)


if __name__ == "__main__":
    sys.exit(main())
