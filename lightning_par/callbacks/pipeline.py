"""The measured pipeline bubble of every training step."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_par.callbacks._group import gather_floats, strategy_pipeline

__all__ = ["PipelineBubbleMonitor"]


class PipelineBubbleMonitor(Callback):
    """Logs ``pipeline/bubble_fraction_mean`` and ``pipeline/bubble_fraction_max`` over the ranks: the share
    of the last training step each rank's stages sat idle (filling and draining the pipeline, and waiting
    for transfers), measured by the pipeline runner (see :mod:`lightning_par.parallel.pipeline.bubble`). Logs nothing
    without pipeline parallelism."""

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pipeline = strategy_pipeline(trainer)
        if pipeline is None or pipeline.bubble_fraction is None:
            return
        fractions = gather_floats(pipeline.bubble_fraction)
        pl_module.log("pipeline/bubble_fraction_mean", sum(fractions) / len(fractions), on_step=True, on_epoch=False)
        pl_module.log("pipeline/bubble_fraction_max", max(fractions), on_step=True, on_epoch=False)
