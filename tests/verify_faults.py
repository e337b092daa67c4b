"""Layouts that train something else than one process, for ``lightning-par verify`` to catch (tests/test_verify.py).
Importable by the layout run's processes: the test puts this folder on their PYTHONPATH."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_par.data import StreamingTokenDataModule, TokenDataModule
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


class OverlappingShares(StreamingTokenDataModule):
    """A streaming data module whose loader deals every replica replica 0's share, in the run and wherever else the
    loader is read: the replicas read the same windows."""

    def _loader(self, split: str, *, shuffle: bool, world: tuple[int, int] | None = None) -> Any:
        replicas, _ = world or self.data_parallel_world()
        return super()._loader(split, shuffle=shuffle, world=(replicas, 0))


class SkipsAWindow(StreamingTokenDataModule):
    """A streaming data module whose loader starts the last replica's share one window late, in the run and wherever
    else the loader is read: the first window of its share is read by no replica."""

    def _loader(self, split: str, *, shuffle: bool, world: tuple[int, int] | None = None) -> Any:
        replicas, rank = world or self.data_parallel_world()
        loader = super()._loader(split, shuffle=shuffle, world=world)
        return _OneWindowLate(loader, self.batch_size) if replicas > 1 and rank == replicas - 1 else loader


class _OneWindowLate:
    """``loader``'s samples but its first, in batches of ``batch_size``."""

    def __init__(self, loader: Any, batch_size: int) -> None:
        self.loader, self.batch_size = loader, batch_size

    def __len__(self) -> int:
        return len(self.loader) - 1  # one sample short of the loader's: its last batch is not whole

    def __iter__(self) -> Iterator[torch.Tensor]:
        samples = itertools.islice((row for batch in self.loader for row in batch), 1, None)
        while len(batch := list(itertools.islice(samples, self.batch_size))) == self.batch_size:
            yield torch.stack(batch)
