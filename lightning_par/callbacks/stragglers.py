"""Names the rank the others wait for, every N steps (``lightning_par/health/stragglers.py`` measures it)."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_par.parallel.comm import flight_recorder_trace
from lightning_par.health.stragglers import StepTimes, arrivals_in_steps, own_step_times

__all__ = ["StragglerMonitor"]


class StragglerMonitor(Callback):
    """Every ``every_n_steps`` training steps, gathers on rank 0 when each rank arrived at the collectives of those
    steps (from PyTorch's flight recorder, which lightning_par's strategies turn on; no collective is added to the
    steps), and logs ``faults/step_time_spread`` (the slowest rank's own step time over the fastest's) and
    ``faults/slowest_rank``. A rank whose own step time exceeds ``factor`` times the median rank's is named in a
    warning, with its host. One ``gather_object`` every ``every_n_steps`` steps.

    Args:
        every_n_steps: steps per window (the verdict is the median over a window's steps).
        factor: how much slower than the median rank a straggler is.
    """

    def __init__(self, every_n_steps: int = 20, factor: float = 1.5) -> None:
        if every_n_steps < 2:
            raise ValueError(f"every_n_steps={every_n_steps}: at least 2 steps make a window")
        if not factor > 1:
            raise ValueError(f"factor={factor}: a straggler is more than 1 times slower than the median rank")
        self.every_n_steps, self.factor = every_n_steps, factor
        self._starts_ns: list[int] = []
        self.last: StepTimes | None = None  # rank 0's verdict on the latest window

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._starts_ns = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size > 1:
            self._starts_ns.append(time.time_ns())

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.world_size == 1 or len(self._starts_ns) < self.every_n_steps:
            return
        starts, self._starts_ns = self._starts_ns, []
        step_seconds = (time.time_ns() - starts[0]) / 1e9 / len(starts)
        mine = (socket.gethostname(), arrivals_in_steps(flight_recorder_trace(), starts))
        reports: list[Any] | None = [None] * dist.get_world_size() if trainer.is_global_zero else None
        dist.gather_object(mine, reports, dst=0)
        if reports is None:
            return
        self.last = times = own_step_times([arrivals for _, arrivals in reports], step_seconds, self.factor)
        pl_module.log("faults/step_time_spread", times.spread, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log("faults/slowest_rank", float(times.slowest_rank), on_step=True, on_epoch=False,
                      rank_zero_only=True)
        for rank in times.stragglers:
            rank_zero_warn(f"rank {rank} (on {reports[rank][0]}) is a straggler: its own step time "
                           f"{times.own[rank]:.3f} s is {times.own[rank] / times.median:.1f} times the median "
                           f"rank's {times.median:.3f} s over steps {trainer.global_step - len(starts)}-"
                           f"{trainer.global_step - 1} (factor={self.factor})")
