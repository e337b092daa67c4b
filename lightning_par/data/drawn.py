"""The training batches one process draws from a data module for a run of several data-parallel replicas:
``lightning-par verify``'s reference trains on them, not on what the layout run's ranks read, so a data module
whose replicas read the wrong samples fails verify.

One process reads the data module at world size 1 and deals its order to the replicas as Lightning's
``DistributedSampler`` does (``torch.utils.data.DistributedSampler``: sample ``i`` of the epoch's order goes to
replica ``i % replicas``; the order is cut, or padded by its first samples, to a multiple of the replicas):

- a map-style loader: the order of its own ``DistributedSampler`` at world size 1, or of the
  ``DistributedSampler`` Lightning puts in place of a random or sequential sampler (seeded by the run's seed), or
  of any other sampler as it iterates; each replica's samples are batched and collated by the loader's own
  ``batch_size``, ``drop_last`` and ``collate_fn``;
- an iterable loader: its batches in turn, one to each replica;
- a data module that streams token shards (``streamed_training()``, lightning_par/data/shard_windows.py) and
  reads them in the documented order (no shuffle, one source, no loader workers): the windows read from the shard
  files themselves and placed in that order (docs/data.md, "Shares"), by code that shares nothing with its loader;
- any other data module that deals its data itself (a shuffled stream, a mixture) says how with
  ``replica_dataloader(replica, replicas)``: each replica's loader is read in this one process (its order is the
  loader's own; ``lightning-par verify`` checks the run's samples against the shard files instead,
  lightning_par/data/share_check.py).

Each micro-batch of the run is the replicas' batches joined in replica order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_par.data.shard_windows import StreamedTraining, documented_order, read_windows

__all__ = ["OneProcessData", "dealt", "join_batches", "samples_of", "streamed_training_of"]


class OneProcessData(LightningDataModule):
    """``original``'s training data drawn in one process for ``replicas`` data-parallel replicas (module docstring),
    and otherwise ``original``: its set-up runs and its attributes answer (a model may read the data module's
    tokenizer or packing separator), but no validation data is served. ``seed``: the run's, which Lightning's
    samplers are seeded with."""

    def __init__(self, original: LightningDataModule, replicas: int, seed: int) -> None:
        super().__init__()
        self._original = original
        self._global_batches = _GlobalBatches(original, replicas, seed)

    def __getattr__(self, name: str) -> Any:
        original = self.__dict__.get("_original")
        if original is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(original, name)

    def prepare_data(self) -> None:
        self._original.trainer = self.trainer  # what the original reads of its run (the model's directory)
        self._original.prepare_data()

    def setup(self, stage: str) -> None:
        self._original.trainer = self.trainer
        self._original.setup(stage)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._global_batches, batch_size=None)


class _GlobalBatches(IterableDataset):
    """One epoch of global micro-batches per iteration, the epochs numbered from 0 as Lightning's loop numbers
    them."""

    def __init__(self, original: LightningDataModule, replicas: int, seed: int) -> None:
        self.original, self.replicas, self.seed = original, replicas, seed
        self.epoch = 0
        self.deals_itself = callable(getattr(original, "replica_dataloader", None))
        self.loaders: list[Any] = []  # made once, at the first epoch, and iterated again for each (as Lightning does)

    def __iter__(self) -> Iterator[Any]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        streamed = streamed_training_of(self.original)
        if streamed is not None and streamed.in_documented_order:
            yield from _documented_batches(streamed, self.replicas)
            return
        if self.deals_itself:
            self.loaders = self.loaders or [self.original.replica_dataloader(replica, self.replicas)
                                            for replica in range(self.replicas)]
            for batches in zip(*self.loaders):
                yield join_batches(list(batches))
            return
        self.loaders = self.loaders or [self.original.train_dataloader()]
        (loader,) = self.loaders
        if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
            batches = iter(loader)
            while len(group := [batch for _, batch in zip(range(self.replicas), batches)]) == self.replicas:
                yield join_batches(group)
            return
        order, drop_last = _one_process_order(loader, epoch, self.seed)
        shares = [_batched(loader, dealt(order, replica, self.replicas, drop_last=drop_last))
                  for replica in range(self.replicas)]
        for batches in zip(*shares):
            yield join_batches(list(batches))


def streamed_training_of(original: LightningDataModule) -> StreamedTraining | None:
    """How ``original`` streams token shards, if it does (once set up)."""
    streamed_training = getattr(original, "streamed_training", None)
    return streamed_training() if callable(streamed_training) else None


def _documented_batches(streamed: StreamedTraining, replicas: int) -> Iterator[Tensor]:
    """One epoch of ``streamed``'s global batches, read from its shard files in the documented order."""
    (directory,) = streamed.sources
    windows = read_windows(directory, "train", streamed.seq_len)
    for numbers in documented_order(len(windows), replicas, streamed.batch_size):
        yield torch.from_numpy(windows.take(numbers))


def _one_process_order(loader: DataLoader, epoch: int, seed: int) -> tuple[list[int], bool]:
    """The epoch's sample order of ``loader`` at world size 1, and whether a distributed run cuts it to a multiple
    of the replicas (``drop_last``) rather than pad it."""
    sampler = loader.sampler
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        # What Lightning puts in a distributed run's loader instead (its _get_distributed_sampler), at world size 1.
        sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, seed=seed,
                                     shuffle=isinstance(sampler, RandomSampler))
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
        return list(sampler), sampler.drop_last
    return list(sampler), False


def dealt(order: list[int], replica: int, replicas: int, *, drop_last: bool) -> list[int]:
    """The samples of ``order`` that replica ``replica`` of ``replicas`` reads, as ``DistributedSampler`` deals them:
    the order cut (``drop_last``) or padded with its first samples to a multiple of the replicas, then every
    ``replicas``-th sample from the ``replica``-th."""
    if drop_last:
        order = order[:len(order) - len(order) % replicas]
    elif padding := -len(order) % replicas:
        order = order + (order * (padding // len(order) + 1))[:padding]
    return order[replica::replicas]


def _batched(loader: DataLoader, indices: list[int]) -> Iterator[Any]:
    """``indices`` of ``loader``'s dataset in batches as the loader makes them (its batch size, drop_last and
    collate_fn)."""
    size = loader.batch_size
    for start in range(0, len(indices), size):
        chunk = indices[start:start + size]
        if len(chunk) < size and loader.drop_last:
            return
        yield loader.collate_fn([loader.dataset[index] for index in chunk])


def join_batches(batches: list[Any]) -> Any:
    """One batch of the samples of ``batches`` (tensors joined along the first dimension, in order)."""
    return tree_map(lambda *parts: torch.cat(parts) if isinstance(parts[0], Tensor) else parts[0], *batches)


def samples_of(batch: Any) -> Counter:
    """The samples of ``batch`` as a multiset: each sample is the bytes of its row in every tensor of the batch that
    has one row per sample (the first tensor's length), so two batches of the same samples in another order
    compare equal."""
    tensors = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor) and leaf.dim() > 0]
    if not tensors:
        return Counter()
    rows = len(tensors[0])
    per_sample = [tensor.detach().cpu().contiguous() for tensor in tensors if len(tensor) == rows]
    return Counter(b"".join(tensor[row].reshape(-1).view(torch.uint8).numpy().tobytes() for tensor in per_sample)
                   for row in range(rows))
