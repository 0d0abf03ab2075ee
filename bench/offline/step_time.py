"""Where an engine step's time goes: the model (an eager forward or a replayed plan), the
metadata builder, and everything else on the host (scheduling, sampling, output building), for
`baton.bench.offline.run`."""

from __future__ import annotations

import time
from types import TracebackType


class StepTimer:
    """Times `engine.step`, `engine.forward` (metadata and model, eager or replayed), the
    metadata builders of both runners and, with speculation, the drafter's forwards
    (`runner.draft`: an MTP head's passes, replayed or eager, with whatever metadata they
    make) while active (instance-level wrappers, removed on exit): model time = forward -
    metadata (the target's); host time = step - model, of which the draft passes and the
    target's metadata are parts."""

    def __init__(self, engine) -> None:
        self.engine = engine
        graphs = getattr(engine, "graph_runner", None)
        self.builders = [engine.runner] + ([graphs] if graphs is not None else [])
        self.steps = 0
        self.step_s = 0.0
        self.forward_s = 0.0
        self.metadata_s = 0.0
        self.draft_s = 0.0
        self.drafting = False  # inside runner.draft: its builds count as the draft's

    def _timed(self, fn, field: str):
        def timed(*args, **kwargs):
            if field == "metadata_s" and self.drafting:
                return fn(*args, **kwargs)
            self.drafting |= field == "draft_s"
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
                if field == "step_s":
                    self.steps += 1
                if field == "draft_s":
                    self.drafting = False

        return timed

    def __enter__(self) -> StepTimer:
        self.engine.step = self._timed(self.engine.step, "step_s")
        self.engine.forward = self._timed(self.engine.forward, "forward_s")
        for runner in self.builders:
            runner.build = self._timed(runner.build, "metadata_s")
        if getattr(self.engine, "drafter", None) is not None:
            self.engine.runner.draft = self._timed(self.engine.runner.draft, "draft_s")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for owner, name in [
            (self.engine, "step"),
            (self.engine, "forward"),
            (self.engine.runner, "draft"),
        ] + [(runner, "build") for runner in self.builders]:
            vars(owner).pop(name, None)  # the class's method again

    def summary(self) -> dict[str, float | int]:
        steps = max(1, self.steps)
        model_s = self.forward_s - self.metadata_s
        graphs = getattr(self.engine, "graph_runner", None)
        return {
            "steps": self.steps,
            "step_ms": 1e3 * self.step_s / steps,
            "forward_ms": 1e3 * model_s / steps,
            "metadata_ms": 1e3 * self.metadata_s / steps,
            "draft_ms": 1e3 * self.draft_s / steps,
            "host_ms": 1e3 * (self.step_s - model_s) / steps,
            "host_fraction": (self.step_s - model_s) / max(self.step_s, 1e-12),
            "replayed_steps": getattr(graphs, "num_replays", 0),
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
