"""A DataLoader that resumes mid-epoch at the batch where its checkpoint was taken.

Lightning restarts an epoch's iteration from its first batch when it resumes from a checkpoint saved
inside the epoch, unless the loader is *stateful* (has ``state_dict`` / ``load_state_dict``): then it
saves the loader's state in the checkpoint and loads it before iterating again. This loader is stateful.
It counts the batches it has handed out in the current epoch and, after ``load_state_dict``, leaves out
that many batches of *indices* at the start of the next epoch's iteration, so no sample is loaded twice
or skipped, and nothing is read just to be thrown away (Megatron-LM resumes its samplers the same way,
by consumed-sample count).

Lightning fetches no batch ahead for a loader with a length, so at any checkpoint taken at a batch
boundary the count equals the batches trained. The loader also owns the generator that seeds its
worker processes, saved as it was when the epoch began, so workers' random transforms repeat too and
starting an epoch draws nothing from the global RNG.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["ResumableDataLoader"]


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` with ``state_dict`` / ``load_state_dict`` for exact mid-epoch resume.

    Takes the same arguments as ``DataLoader``. The state holds the batches handed out in the current
    epoch and the global batch (``batch_size`` x data-parallel replicas): a checkpoint taken under
    another data-parallel size resumes at the same number of samples when that count is a whole number
    of the new global batches.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(torch.initial_seed() % 2**63)
        super().__init__(*args, **kwargs)
        self._batches_in_epoch = 0
        self._batches_to_skip = 0
        self._epoch_generator_state = self.generator.get_state()

    def __iter__(self) -> Iterator[Any]:
        self._epoch_generator_state = self.generator.get_state()
        self._batches_in_epoch = self._batches_to_skip
        # Building the iterator reads the index sampler (twice with worker processes): the skip applies there.
        batches = super().__iter__()
        self._batches_to_skip = 0
        for batch in batches:
            self._batches_in_epoch += 1
            yield batch

    @property
    def _index_sampler(self) -> Any:
        return _SkipFirstBatches(self, super()._index_sampler)

    def state_dict(self) -> dict[str, Any]:
        return {
            "batches_in_epoch": self._batches_in_epoch,
            "global_batch": self._global_batch(),
            "generator_at_epoch_start": self._epoch_generator_state,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        samples = state["batches_in_epoch"] * state["global_batch"]
        batches, remainder = divmod(samples, self._global_batch())
        if remainder:
            warnings.warn(
                f"the checkpoint stopped {samples} samples into its epoch, which is not a whole number of this "
                f"run's global batch ({self._global_batch()}); resuming after {batches * self._global_batch()}",
                stacklevel=2,
            )
        if batches < len(self):  # inside the epoch: iterate it again from its start, less what was trained
            self._batches_to_skip = batches
            self.generator.set_state(state["generator_at_epoch_start"])
        else:  # the epoch had ended: the next one starts afresh
            self._batches_to_skip = 0
            self.generator.set_state(state["generator"])

    def _global_batch(self) -> int:
        replicas = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return (self.batch_size or 1) * replicas


class _SkipFirstBatches:
    """The loader's batch sampler, less the batches a resumed epoch has already trained on.

    Read at every ``iter()``: a worker pool keeps its index sampler between epochs, and later epochs, which
    the loader starts with nothing to skip, are whole.
    """

    def __init__(self, loader: ResumableDataLoader, sampler: Any) -> None:
        # Weakly: a worker pool holds this sampler and its loader holds the pool, and a loader left in such a
        # cycle waits for the garbage collector, which closes the pool's queues before telling its workers to stop
        # (they are then waited for 5 s each).
        self._loader, self.sampler = weakref.ref(loader), sampler

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        return itertools.islice(iter(self.sampler), loader._batches_to_skip if loader is not None else 0, None)

    def __len__(self) -> int:
        return len(self.sampler)
