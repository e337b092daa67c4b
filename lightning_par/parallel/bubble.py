"""The pipeline bubble of a training step, measured: the share of the step a rank's stages sat idle.

A schedule step on one rank is stage compute (each micro-batch's forward, backward, and under the
zero-bubble schedules the separate weight-gradient pass) and waiting: for activations and gradients in
flight, and in the bubble while the pipeline fills and drains. :class:`BubbleMeter` times the compute
calls of the rank's ``PipelineStage`` objects (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``) and reports ``1 - busy / step``, the idle fraction that the GPipe / 1F1B
bound ``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2021) describes, plus whatever
point-to-point transfers add. On CUDA the compute is timed with events on the stream, not on the host.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

__all__ = ["BubbleMeter"]

_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BubbleMeter:
    """Times the compute of ``stages`` within a step: ``start()``, run the schedule, ``stop() -> idle fraction``."""

    def __init__(self, stages: list[Any], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._busy = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._started: float | None = None
        for stage in stages:
            for name in _COMPUTE:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(compute)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._started is None:  # outside a measured step (evaluation): not counted
                return compute(*args, **kwargs)
            if self._cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                result = compute(*args, **kwargs)
                end.record()
                self._events.append((begin, end))
                return result
            begin = time.perf_counter()
            result = compute(*args, **kwargs)
            self._busy += time.perf_counter() - begin
            return result

        return timed

    def start(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._busy, self._events = 0.0, []
        self._started = time.perf_counter()

    def stop(self) -> float:
        """The idle fraction of the step since :meth:`start`, in [0, 1]."""
        if self._cuda:
            torch.cuda.synchronize()
            self._busy = sum(begin.elapsed_time(end) for begin, end in self._events) / 1000
        step = time.perf_counter() - (self._started or 0.0)
        self._started = None
        return min(1.0, max(0.0, 1.0 - self._busy / step)) if step > 0 else 0.0
