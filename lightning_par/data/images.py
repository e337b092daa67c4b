"""Synthetic labelled images, for training vision models with no download.

Each class has a fixed random template; a sample is its class's template plus noise, both drawn from a generator
seeded by the sample's index, so any sample is the same whichever rank or epoch reads it and a model can learn
the classes. Batches are ``(images, labels)``: float (B, channels, size, size) and long (B,); with
``with_index=True``, ``(images, labels, indices)``, from which a diffusion model seeds each sample's noise (the same
draws whatever the layout).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_par.data.datamodule import ShardedDataModule


class SyntheticImageDataset(Dataset):
    """``num_samples`` (image, label) pairs; sample ``i`` has label ``i % classes``."""

    def __init__(self, num_samples: int, image_size: int, channels: int, classes: int, seed: int,
                 noise: float = 0.5, with_index: bool = False) -> None:
        self.num_samples, self.classes, self.seed, self.noise = num_samples, classes, seed, noise
        self.with_index = with_index
        self.shape = (channels, image_size, image_size)
        templates = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, *self.shape, generator=templates)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        label = index % self.classes
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = self.templates[label] + self.noise * torch.randn(self.shape, generator=generator)
        return (image, torch.tensor(label)) + ((torch.tensor(index),) if self.with_index else ())


class SyntheticImageDataModule(ShardedDataModule):
    """Batches of synthetic labelled images (see the module docstring), sharded over the data-parallel ranks.

    Args:
        image_size: height and width of each image.
        channels: colour channels.
        classes: number of classes (labels ``0 .. classes - 1``).
        batch_size: samples per batch on each data-parallel rank.
        num_samples / num_val_samples: images in the training and validation splits.
        seed: seed of the templates and the noise (validation draws other noise from the same templates).
        with_index: add each sample's index to the batch: ``(images, labels, indices)``.
        num_workers: DataLoader worker processes.
        shuffle: shuffle the training set.
    """

    def __init__(self, image_size: int = 32, channels: int = 3, classes: int = 10, batch_size: int = 16,
                 num_samples: int = 2048, num_val_samples: int = 256, seed: int = 0, with_index: bool = False,
                 num_workers: int = 0, shuffle: bool = True) -> None:
        for name, value in (("image_size", image_size), ("channels", channels), ("classes", classes),
                            ("batch_size", batch_size), ("num_samples", num_samples),
                            ("num_val_samples", num_val_samples)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SyntheticImageDataModule({name}={value!r}): give a positive integer")
        super().__init__(batch_size=batch_size, num_workers=num_workers, shuffle=shuffle)
        self.save_hyperparameters()

    def _build(self, split: str) -> Dataset:
        if split not in self._full:
            hp = self.hparams
            samples = hp.num_samples if split == "train" else hp.num_val_samples
            dataset = SyntheticImageDataset(samples, hp.image_size, hp.channels, hp.classes, hp.seed,
                                            with_index=hp.with_index)
            if split == "val":  # the same templates, other noise
                dataset.seed = hp.seed + 2**31
            self._full[split] = dataset
        return self._full[split]


__all__ = ["SyntheticImageDataModule", "SyntheticImageDataset"]
