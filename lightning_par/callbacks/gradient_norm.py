"""The global gradient norm, over every shard, stage and partition of the model."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["GradientNormMonitor", "whole_gradient_norm"]


def whole_gradient_norm(trainer: Trainer, optimizer: Optimizer) -> float:
    """The 2-norm of the gradient of ``optimizer``'s parameters, as one process holding the whole model would see it:
    through a lightning_par strategy (collective on every rank), else from this process's gradients."""
    if hasattr(trainer.strategy, "gradient_norm"):
        return trainer.strategy.gradient_norm(optimizer)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.detach().float()) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


class GradientNormMonitor(Callback):
    """Logs ``train/grad_norm``, the 2-norm of the whole model's gradient before clipping, at every optimizer
    step. Under a lightning_par strategy it is assembled from tensor-parallel and ZeRO shards and pipeline
    stages (the norm one process holding the whole model would see); otherwise from local gradients."""

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        pl_module.log("train/grad_norm", whole_gradient_norm(trainer, optimizer), on_step=True, on_epoch=False)
