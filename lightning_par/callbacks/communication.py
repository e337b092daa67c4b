"""Bytes each mesh dimension moved per step, from the project's collective accounting."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_par.callbacks._group import strategy_mesh, strategy_pipeline
from lightning_par.parallel.comm import CommunicationCounter

__all__ = ["CommunicationMonitor"]


class CommunicationMonitor(Callback):
    """Logs, after each training batch, what rank 0's collectives moved while it trained, per mesh
    dimension (``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``other``): ``comm/<dim>_bytes``, ``comm/<dim>_calls``
    and, where the backend times collectives (NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``), ``comm/<dim>_seconds``.
    Dimensions that moved nothing in the run so far are left out. See :mod:`lightning_par.parallel.comm`.

    Needs a lightning_par strategy (its mesh names the process groups, and it turns the flight recorder on).
    """

    def __init__(self) -> None:
        self._counter: CommunicationCounter | None = None
        self._seen: set[str] = set()
        self._warned = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mesh = strategy_mesh(trainer)
        pipeline = strategy_pipeline(trainer)
        sends = pipeline.sends if pipeline is not None else None
        self._counter = (CommunicationCounter(mesh, pipeline_sends=sends)
                         if mesh is not None and trainer.world_size > 1 else None)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._counter is not None:
            self._counter.read()  # what ran between the batches (validation, a checkpoint's save) is not the step's

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._counter is None:
            return
        totals = self._counter.read()
        if self._counter.lost and not self._warned:
            self._warned = True
            rank_zero_warn("more collectives ran between two batches than PyTorch's flight recorder keeps: comm/* "
                           "undercounts; raise TORCH_FR_BUFFER_SIZE (set it before the run starts)")
        for dimension, total in totals.items():
            if total.calls:
                self._seen.add(dimension)
            if dimension not in self._seen:
                continue
            pl_module.log(f"comm/{dimension}_bytes", float(total.bytes), on_step=True, on_epoch=False)
            pl_module.log(f"comm/{dimension}_calls", float(total.calls), on_step=True, on_epoch=False)
            if total.seconds is not None:
                pl_module.log(f"comm/{dimension}_seconds", total.seconds, on_step=True, on_epoch=False)
