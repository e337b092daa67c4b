"""The batches another run trained on, handed out again in the same order (``lightning-par verify``'s reference)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

__all__ = ["ReplayedData"]


class ReplayedData(LightningDataModule):
    """``batches`` (one per training step of the loop, already collated) as the training data, and otherwise
    ``original``: its set-up runs and its attributes answer (a model may read the datamodule's tokenizer or packing
    separator), but no validation data is served."""

    def __init__(self, original: LightningDataModule | None, batches: list[Any]) -> None:
        super().__init__()
        self._original = original
        self._batches = batches

    def __getattr__(self, name: str) -> Any:
        original = self.__dict__.get("_original")
        if original is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(original, name)

    def prepare_data(self) -> None:
        if self._original is not None:
            self._original.trainer = self.trainer  # what the original reads of its run (the model's directory)
            self._original.prepare_data()

    def setup(self, stage: str) -> None:
        if self._original is not None:
            self._original.trainer = self.trainer
            self._original.setup(stage)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._batches, batch_size=None, shuffle=False)  # type: ignore[arg-type]
