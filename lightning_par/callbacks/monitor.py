"""Every monitor of a distributed run in one callback, each switchable (the CLI's ``monitor:`` section)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.callbacks.communication import CommunicationMonitor
from lightning_par.callbacks.gradient_norm import GradientNormMonitor
from lightning_par.callbacks.layout import LayoutSummary
from lightning_par.callbacks.memory import MemoryMonitor
from lightning_par.callbacks.pipeline import PipelineBubbleMonitor
from lightning_par.callbacks.stragglers import StragglerMonitor
from lightning_par.callbacks.throughput import ThroughputMonitor

__all__ = ["ParallelMonitor"]


class ParallelMonitor(Callback):
    """Throughput and MFU, peak memory, communication per mesh dimension, pipeline bubble, gradient norm,
    stragglers and the layout table.

    The ``lightning-par`` command adds it to every run (``--monitor.memory=false`` etc. switch parts off);
    in your own code add it, or the single monitors, to ``Trainer(callbacks=[...])``.

    Args:
        throughput, memory, communication, pipeline_bubble, gradient_norm, stragglers, layout: which monitors run.
        peak_flops_per_device: the device's peak FLOP/s for MFU (see :class:`ThroughputMonitor`).
    """

    def __init__(self, throughput: bool = True, memory: bool = True, communication: bool = True,
                 pipeline_bubble: bool = True, gradient_norm: bool = True, stragglers: bool = True,
                 layout: bool = True, peak_flops_per_device: float | None = None) -> None:
        chosen = [
            (layout, LayoutSummary()),
            (throughput, ThroughputMonitor(peak_flops_per_device)),
            (memory, MemoryMonitor()),
            (communication, CommunicationMonitor()),
            (pipeline_bubble, PipelineBubbleMonitor()),
            (gradient_norm, GradientNormMonitor()),
            (stragglers, StragglerMonitor()),
        ]
        self.monitors = [monitor for wanted, monitor in chosen if wanted]

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for monitor in self.monitors:
            monitor.on_fit_start(trainer, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for monitor in self.monitors:
            monitor.on_train_start(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        for monitor in self.monitors:
            monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for monitor in self.monitors:
            monitor.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        for monitor in self.monitors:
            monitor.on_before_optimizer_step(trainer, pl_module, optimizer)
