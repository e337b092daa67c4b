"""Every batch a pipeline trains on is a full one: the partial last batch of an epoch is dropped.

A pipeline schedule cuts each batch into a fixed number of micro-batches of one shape (the stages' buffers are
sized from the first), so the short batch a loader with ``drop_last=False`` hands out at the end of each epoch
cannot run. Megatron-LM trains on a fixed global batch and drops that remainder; so does this: for a loader that
batches a map-style dataset with torch's ``BatchSampler``, the batch sampler is told to drop it (the loader's length,
which Lightning's loops count, follows), and the run says so once. A loader that batches otherwise (its own batch
sampler, an iterable dataset) is left as it is: a short batch from it is refused at that step, with the fix.
Evaluation needs no such rule: it pads a short batch and cuts the output back (``PipelineRunner.forward``).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

__all__ = ["drop_partial_last_batch"]


def drop_partial_last_batch(loader: Any, log: Callable[[str], None]) -> Any:
    """The training ``loader`` with its partial last batch dropped (in place; see the module docstring), logged
    through ``log`` when there is one."""
    batching_indices = isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)
    batches = loader.batch_sampler if batching_indices else None
    if type(batches) is not BatchSampler or batches.drop_last:
        return loader
    samples, batch_size = len(batches.sampler), batches.batch_size
    if samples % batch_size:
        batches.drop_last = True  # read at every epoch's iter() and by len(): no loader is rebuilt
        log(f"pipeline parallel: the last {samples % batch_size} of the {samples} training samples of each epoch on "
            f"each data-parallel rank are left out, as a fixed global batch does (a batch of {batch_size} splits "
            "into the schedule's micro-batches, a shorter one does not)")
    return loader
