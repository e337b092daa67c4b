"""What a run trained, step by step, for ``lightning-par verify`` to hold one run against another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from torch.utils._pytree import tree_map
from typing_extensions import override

from lightning_par.callbacks.gradient_norm import whole_gradient_norm
from lightning_par.data.datamodule import data_parallel_world

__all__ = ["StepRecord"]


class StepRecord(Callback):
    """Records, on every rank, the batches it trained on with the epoch of each, and the loss of each (as the whole
    global batch's mean: Lightning's loss times ``accumulate_grad_batches``), the whole model's gradient norm before
    each optimizer step (:func:`~lightning_par.callbacks.gradient_norm.whole_gradient_norm`) and, on global rank 0,
    the whole model's weights before the first step and after each (``consolidated_state_dict`` under a lightning_par
    strategy). At the end of training each rank writes ``folder/rank{global_rank}.pt``, with its data-parallel
    replica's index.

    Each step's weights are whole tensors on rank 0: for the models that ``lightning-par verify`` runs (what one CPU
    process holds), not for a run at scale."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.batches: list[Any] = []
        self.epochs: list[int] = []  # each batch's: a new epoch may read every sample again
        self.losses: list[float] = []
        self.gradient_norms: list[float] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._keep_weights(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._keep_weights_after_a_step(trainer, pl_module)
        self.batches.append(tree_map(lambda x: x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x, batch))
        self.epochs.append(trainer.current_epoch)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        self.gradient_norms.append(float(whole_gradient_norm(trainer, optimizer)))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) * trainer.accumulate_grad_batches)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._keep_weights_after_a_step(trainer, pl_module)
        replicas, replica = data_parallel_world(trainer)
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save({"replica": replica, "replicas": replicas, "batches": self.batches, "epochs": self.epochs,
                    "losses": self.losses, "gradient_norms": self.gradient_norms, "weights": self.weights,
                    "accumulate": trainer.accumulate_grad_batches, "layout": _layout(trainer)}, self.folder / f"rank{trainer.global_rank}.pt")

    def _keep_weights_after_a_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Read before the next batch rather than at the end of this one, so that the collectives of reading them
        # fall between two steps, where the CommunicationMonitor does not count them.
        if trainer.global_step == len(self.weights):  # an optimizer step was taken since the last weights kept
            self._keep_weights(trainer, pl_module)

    def _keep_weights(self, trainer: Trainer, pl_module: LightningModule) -> None:
        consolidate = getattr(trainer.strategy, "consolidated_state_dict", None)
        state = consolidate() if consolidate is not None else pl_module.state_dict()  # collective in the former
        self.weights.append({name: tensor.detach().cpu().clone() for name, tensor in state.items()})


def _layout(trainer: Trainer) -> str:
    config = getattr(trainer.strategy, "parallel_config", None)
    return config.describe() if config is not None else f"{type(trainer.strategy).__name__} on one device"
