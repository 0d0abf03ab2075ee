"""Where an engine step's time goes: the model forward vs everything around it on the host
(scheduling, metadata, sampling, output building), for `bench.offline`."""

from __future__ import annotations

import time
from types import TracebackType


class StepTimer:
    """Times `engine.step` and the model's forward while active (instance-level wrappers,
    removed on exit); host time = step time - forward time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model = engine.runner.model
        self.steps = 0
        self.step_s = 0.0
        self.forward_s = 0.0

    def __enter__(self) -> StepTimer:
        step, forward = self.engine.step, self.model.forward
        self._originals = (step, forward)

        def timed_step(*args, **kwargs):
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.step_s += time.perf_counter() - start
                self.steps += 1

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.forward_s += time.perf_counter() - start

        self.engine.step = timed_step
        self.model.forward = timed_forward
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.engine.step, self.model.forward = self._originals

    def summary(self) -> dict[str, float | int]:
        steps = max(1, self.steps)
        return {
            "steps": self.steps,
            "step_ms": 1e3 * self.step_s / steps,
            "forward_ms": 1e3 * self.forward_s / steps,
            "host_ms": 1e3 * (self.step_s - self.forward_s) / steps,
            "host_fraction": (self.step_s - self.forward_s) / max(self.step_s, 1e-12),
        }
