"""Layouts that train something else than one process, for ``lightning-par verify`` to catch (tests/test_verify.py).
Importable by the layout run's processes: the test puts this folder on their PYTHONPATH."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_par.data import TokenDataModule
from lightning_par.models import LlamaLM
from lightning_par.strategies import Hybrid3DStrategy


class DropsGradientAverage(Hybrid3DStrategy):
    """Hybrid 3-D parallel whose replicas never average their gradients: each steps on its own samples."""

    def _parallelize(self, module: nn.Module, trainer: Any, *, training: bool) -> Any:
        handle = super()._parallelize(module, trainer, training=training)
        handle.reduces_after_backward = False
        return handle


class UntiesItsHead(LlamaLM):
    """A model whose head is tied to its embedding in one process and untied (a copy) on several."""

    def configure_model(self) -> None:
        super().configure_model()
        if self.trainer.world_size > 1:
            head = self.model.lm_head
            head.weight = nn.Parameter(head.weight.detach().clone())


class ReadsTheSameSamples(TokenDataModule):
    """A data module that shards for one replica whatever the run: every data-parallel replica reads every sample."""

    def data_parallel_world(self) -> tuple[int, int]:
        return 1, 0
