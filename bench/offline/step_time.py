"""Where an engine step's time goes: the model forward vs everything around it on the host
(scheduling, metadata, sampling, output building), for `baton.bench.offline.run`."""

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


class MatmulTimer:
    """Times every linear layer's forward under `model` while active (packed or plain; instance
    wrappers, removed on exit) and counts its FLOPs, 2 x rows x in x out per call: the rate the
    matmuls of a step reach, apart from the rest of the step. Experts of fused MoE layers are
    not linear modules and are not counted."""

    def __init__(self, model) -> None:
        from torch import nn

        from baton.kernels.linear import PackedLinear

        self.modules = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
        self.seconds = 0.0
        self.flops = 0
        self.calls = 0

    def __enter__(self) -> MatmulTimer:
        for module in self.modules:
            module.forward = self._timed(module, module.forward)
        return self

    def _timed(self, module, forward):
        per_row = 2 * module.in_features * module.out_features

        def timed(x, *args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(x, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.flops += per_row * (x.numel() // x.shape[-1])
                self.calls += 1

        return timed

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for module in self.modules:
            del module.forward  # the class's forward again

    def rate(self) -> float:
        """FLOP/s of the timed matmuls (0 when none ran)."""
        return self.flops / self.seconds if self.seconds else 0.0
