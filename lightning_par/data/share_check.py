"""Whether the samples data-parallel replicas trained on are a share of the shard files, checked from the files
alone (``shard_windows``): every sample is a window of the files, cut at a window boundary, and within an epoch no
window is read more often than the files hold it (a window whose tokens the files repeat counts as often as they
do). That holds whatever order the loader reads in, litdata's seeded shuffle and a mixture's draws included, so
``lightning-par verify`` checks it where the order itself cannot be reproduced without the loader's code.

Pure NumPy: no lightning, torch or litdata import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from lightning_par.data.shard_windows import ShardWindows

__all__ = ["WindowIndex", "first_misread"]


def _key(tokens: np.ndarray) -> bytes:
    # A digest rather than the tokens themselves: the index holds every window of the files at once.
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class WindowIndex:
    """Where each window's tokens lie in the shard files of ``sources`` (``{name: windows}``): every place, since
    the files may hold the same tokens in several windows."""

    def __init__(self, sources: dict[str, ShardWindows]) -> None:
        self.places: dict[bytes, list[tuple[str, int]]] = {}
        for name, windows in sources.items():
            for number, window in enumerate(windows):
                self.places.setdefault(_key(window), []).append((name, number))

    def places_of(self, sample: np.ndarray) -> list[tuple[str, int]]:
        """The windows (source, number) holding ``sample``'s tokens (none: it is not a window of the files)."""
        return self.places.get(_key(sample), [])


def first_misread(batches: Sequence[np.ndarray], epochs: Sequence[int], replicas: int, accumulate: int,
                  index: WindowIndex) -> tuple[int, str] | None:
    """The first micro-batch of ``batches`` (each the replicas' batches joined in replica order, one window a row)
    holding a sample that is not a window of the files ``index`` holds, or one read more often in its epoch
    (``epochs``: each micro-batch's) than the files hold it; with the reason, naming the replica and the step
    (``accumulate`` micro-batches a step). None when every sample is a share's."""
    read: dict[bytes, list[tuple[int, int]]] = {}
    for micro_batch, (rows, epoch) in enumerate(zip(batches, epochs)):
        if micro_batch == 0 or epoch != epochs[micro_batch - 1]:
            read = {}  # a new epoch reads every window again
        per_replica = max(len(rows) // replicas, 1)
        step = micro_batch // accumulate + 1
        for row_number, row in enumerate(rows):
            replica, key = row_number // per_replica, _key(row)
            places = index.places.get(key)
            if places is None:
                return micro_batch, (f"replica {replica} trained at step {step} on a sample that is not a window of "
                                     "the shard files (seq_len + 1 tokens cut from a shard file's start, without "
                                     "overlap: docs/data.md, 'Samples')")
            readers = read.setdefault(key, [])
            if len(readers) == len(places):
                first_step, first_replica = readers[0]
                name, number = places[0]
                return micro_batch, (f"replica {replica} read at step {step} window {number} of {name}, which replica "
                                     f"{first_replica} read at step {first_step} of this epoch: the replicas' shares "
                                     "overlap (docs/data.md, 'Shares')"
                                     + (f" ({len(places)} windows of the files hold its tokens)"
                                        if len(places) > 1 else ""))
            readers.append((step, replica))
    return None
