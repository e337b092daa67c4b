"""Whether the samples data-parallel replicas trained on are a share of the shard files, checked from the files
alone (``shard_windows``): every sample is a window of the files, cut at a window boundary, and within an epoch no
window is read more often than the files hold it (a window whose tokens the files repeat counts as often as they
do). That holds whatever order the loader reads in, litdata's seeded shuffle and a mixture's draws included, so
``lightning-par verify`` checks it where the order itself cannot be reproduced without the loader's code.

Pure NumPy: no lightning, torch or litdata import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from lightning_par.data.shard_windows import ShardWindows

__all__ = ["WindowIndex", "first_misread"]


def _key(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _prefixes(rows: np.ndarray, width: int) -> np.ndarray:
    """Each row's first ``width`` tokens as one comparable value."""
    prefix = np.ascontiguousarray(rows[:, :width], dtype=np.int64)
    return prefix.view(np.dtype((np.void, prefix.itemsize * width))).ravel()


class WindowIndex:
    """Where the tokens of each of ``samples`` lie in the shard files of ``sources`` (``{name: windows}``): every
    window holding them, since the files may hold the same tokens in several windows.

    Only the samples are indexed, not the files' windows, so that memory stays that of the samples whatever the
    corpus: each file is scanned once, its windows' first tokens compared with the samples' at once, and only the
    windows that begin alike compared whole."""

    _PREFIX = 8  # tokens compared for every window of the files

    def __init__(self, sources: dict[str, ShardWindows], samples: Iterable[np.ndarray]) -> None:
        wanted = {_key(sample): np.asarray(sample) for sample in samples}
        self.places: dict[bytes, list[tuple[str, int]]] = {key: [] for key in wanted}
        lengths = {len(sample) for sample in wanted.values()}
        for name, windows in sources.items():
            first = 0
            for rows in windows.files:
                if len(rows) and rows.shape[1] in lengths:
                    self._find(rows, wanted, name, first)
                first += len(rows)

    def _find(self, rows: np.ndarray, wanted: dict[bytes, np.ndarray], name: str, first: int) -> None:
        width = min(self._PREFIX, rows.shape[1])
        samples = np.stack([sample for sample in wanted.values() if len(sample) == rows.shape[1]])
        for row in np.flatnonzero(np.isin(_prefixes(rows, width), _prefixes(samples, width))):
            key = _key(rows[row])
            if key in self.places:
                self.places[key].append((name, first + int(row)))

    def places_of(self, sample: np.ndarray) -> list[tuple[str, int]]:
        """The windows (source, number) holding the tokens of ``sample``, one of the indexed samples (none: it is
        not a window of the files)."""
        return self.places[_key(sample)]


def first_misread(batches: Sequence[np.ndarray], epochs: Sequence[int], replicas: int, accumulate: int,
                  sources: dict[str, ShardWindows]) -> tuple[int, str] | None:
    """The first micro-batch of ``batches`` (each the replicas' batches joined in replica order, one window a row)
    holding a sample that is not a window of ``sources`` (``{name: windows}``), or one read more often in its epoch
    (``epochs``: each micro-batch's) than the sources hold it; with the reason, naming the replica and the step
    (``accumulate`` micro-batches a step). None when every sample is a share's."""
    index = WindowIndex(sources, (row for rows in batches for row in rows))
    read: dict[bytes, list[tuple[int, int]]] = {}
    for micro_batch, (rows, epoch) in enumerate(zip(batches, epochs)):
        if micro_batch == 0 or epoch != epochs[micro_batch - 1]:
            read = {}  # a new epoch reads every window again
        per_replica = max(len(rows) // replicas, 1)
        step = micro_batch // accumulate + 1
        for row_number, row in enumerate(rows):
            replica, key = row_number // per_replica, _key(row)
            places = index.places[key]
            if not places:
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
