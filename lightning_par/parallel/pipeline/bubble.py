"""The pipeline bubble of a training step, measured: the share of the step a rank's stages sat idle.

A schedule step on one rank is stage compute (each micro-batch's forward, backward, and under the
zero-bubble schedules the separate weight-gradient pass) and waiting: for activations and gradients in
flight, and in the bubble while the pipeline fills and drains. :class:`BubbleMeter` times the compute
calls of the rank's ``PipelineStage`` objects (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``) and reports ``1 - busy / step``, the idle fraction that the GPipe / 1F1B
bound ``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2021) describes, plus whatever
point-to-point transfers add. On CUDA the compute is timed with events on the stream, not on the host.

The meter also records the order in which the rank ran its compute (``actions``). :func:`simulated_timeline`
replays the recorded orders of every rank with fixed costs per action, and :func:`simulated_bubble` reads the
bubble the schedule implies off it, independent of machine load: that is what tests assert, while the measured
fraction is what a run reports. ``docs/plot_schedules.py`` draws the timeline.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

__all__ = ["Action", "BubbleMeter", "simulated_bubble", "simulated_timeline"]

_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

# (stage index, kind, micro-batch): kind F (forward), B (whole backward), I (input-gradient half of
# backward) or W (weight-gradient half), as torch.distributed.pipelining names them.
Action = tuple[int, str, int]


def _kind(method: str, kwargs: dict[str, Any], args: tuple) -> str:
    if method == "forward_one_chunk":
        return "F"
    if method == "backward_weight_one_chunk":
        return "W"
    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
    return "B" if full else "I"


class BubbleMeter:
    """Times the compute of ``stages`` within a step: ``start()``, run the schedule, ``stop() -> idle fraction``."""

    def __init__(self, stages: list[Any], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._busy = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._started: float | None = None
        self.actions: list[Action] = []  # this rank's compute of the last measured step, in order
        self.n_stages = stages[0].num_stages if stages else 1
        for stage in stages:
            for name in _COMPUTE:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), stage.stage_index, name))

    def _timed(self, compute: Callable[..., Any], stage_index: int, method: str) -> Callable[..., Any]:
        @functools.wraps(compute)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._started is None:  # outside a measured step (evaluation): not counted
                return compute(*args, **kwargs)
            microbatch = args[0] if args else next(iter(kwargs.values()))
            self.actions.append((stage_index, _kind(method, kwargs, args), int(microbatch)))
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
        self._busy, self._events, self.actions = 0.0, [], []
        self._started = time.perf_counter()

    def stop(self) -> float:
        """The idle fraction of the step since :meth:`start`, in [0, 1]."""
        if self._cuda:
            torch.cuda.synchronize()
            self._busy = sum(begin.elapsed_time(end) for begin, end in self._events) / 1000
        step = time.perf_counter() - (self._started or 0.0)
        self._started = None
        return min(1.0, max(0.0, 1.0 - self._busy / step)) if step > 0 else 0.0


def simulated_timeline(actions: dict[int, list[Action]], n_stages: int,
                       costs: dict[str, float] | None = None) -> dict[int, list[tuple[float, float, Action]]]:
    """When each rank's recorded ``actions`` run, in order, with fixed costs: per rank ``(start, end, action)``.

    A forward of stage ``s`` waits for the forward of ``s - 1`` on the same micro-batch; a backward (``B``
    or ``I``) of ``s`` waits for the backward of ``s + 1`` (the last stage: for its own forward); a ``W`` for
    its own stage's backward. Transfers cost nothing; by default F = I = W = 1 and B = I + W. Raises
    ``ValueError`` when the orders deadlock (a schedule that cannot run).
    """
    costs = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0, **(costs or {})}
    done: dict[tuple[int, str, int], float] = {}  # (stage, F or backward, micro-batch) -> finish time
    clock = {rank: 0.0 for rank in actions}
    timeline: dict[int, list[tuple[float, float, Action]]] = {rank: [] for rank in actions}
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank, sequence in actions.items():
            while len(timeline[rank]) < len(sequence):
                stage, kind, micro = sequence[len(timeline[rank])]
                if kind == "F":
                    needs = [(stage - 1, "F", micro)] if stage > 0 else []
                elif kind in ("B", "I"):
                    needs = [(stage + 1, "bwd", micro)] if stage < n_stages - 1 else [(stage, "F", micro)]
                else:
                    needs = [(stage, "bwd", micro)]
                if any(need not in done for need in needs):
                    break
                start = max([clock[rank], *(done[need] for need in needs)])
                clock[rank] = start + costs[kind]
                timeline[rank].append((start, clock[rank], (stage, kind, micro)))
                done[(stage, "F" if kind == "F" else ("W" if kind == "W" else "bwd"), micro)] = clock[rank]
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {rank: sequence[len(timeline[rank])] for rank, sequence in actions.items()
                     if len(timeline[rank]) < len(sequence)}
            raise ValueError(f"the recorded pipeline orders deadlock: ranks wait on {stuck}")
    return timeline


def simulated_bubble(actions: dict[int, list[Action]], n_stages: int,
                     costs: dict[str, float] | None = None) -> dict[int, float]:
    """The idle fraction of every rank when each runs its recorded ``actions`` in order with fixed costs
    (:func:`simulated_timeline`). With the default costs GPipe and 1F1B leave ``(p - 1) / (m + p - 1)`` of the
    step idle and interleaved 1F1B ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021).
    """
    timeline = simulated_timeline(actions, n_stages, costs)
    makespan = max((runs[-1][1] for runs in timeline.values() if runs), default=0.0)
    if makespan == 0:
        return {rank: 0.0 for rank in actions}
    return {rank: 1.0 - sum(end - start for start, end, _ in runs) / makespan for rank, runs in timeline.items()}
