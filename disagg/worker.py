"""The interface both halves of a disaggregated pair implement (disagg/prefill.py's
PrefillWorker, disagg/decode.py's DecodeWorker): what the engine loop (disagg/process.py) drives,
so nothing there branches on which half it runs."""

from __future__ import annotations

from typing import Protocol

import zmq

from baton.engine.core.engine_args import EngineStats
from baton.engine.core.outputs import RequestDelta
from baton.engine.core.sampling_params import SamplingParams


class DisaggWorker(Protocol):
    @property
    def transfer_address(self) -> str:
        """Where peers reach this worker's transfer socket ("" when it listens on none)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        room: str = "",
        prefill_addr: str = "",
    ) -> None:
        """A request of room `room` ("" : a plain colocated request); the decode half needs the
        prefill worker's transfer address. ValueError for a request that cannot be served."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def computing(self) -> bool:
        """Whether the engine has requests to step (not just rooms waiting on peers)."""
        ...

    def reading(self) -> bool:
        """Whether transfers this worker polls itself are in flight (nixl READs, which wake no
        socket): the loop then looks again within READ_POLL_MS."""
        ...

    def step(self) -> list[RequestDelta]: ...

    def poll(self) -> None:
        """Handle the peers' messages waiting on `sockets()`."""
        ...

    def expire_idle(self) -> bool:
        """Timeouts and heartbeats between steps; True if a room failed."""
        ...

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests whose handover failed since the last call."""
        ...

    def take_refused(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests refused once their grammar compiled (a 400)."""
        ...

    def stats(self) -> EngineStats: ...

    def extra_stats(self) -> dict: ...

    def sockets(self) -> list[zmq.Socket]: ...

    def close(self) -> None: ...
