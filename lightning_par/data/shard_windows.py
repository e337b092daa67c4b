"""The windows of a prepared split read straight from its shard files, and the order in which data-parallel
replicas read them without shuffling (docs/data.md, "Shares"): a reference for the streamed data that shares no code
with the loader that streams it (no litdata, nothing of ``shards`` or ``streaming``), so that a sharding fault of the
loader cannot hide in the reference too (``lightning-par verify``).

A split directory holds ``index.json`` (its shard files in order, each with its size in bytes) and the shard files.
A shard file is a header of uint32: the number of items ``n``, then ``n + 1`` byte offsets into the file (the first
item's start, each next item's start, the file's end); the items are the documents' tokens, back to back, in the
dtype ``prepared.json`` names. Windows of ``seq_len + 1`` tokens are cut from each file's start without overlap, its
last partial window dropped.

Pure NumPy: no lightning, torch or litdata import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["ShardWindows", "StreamedTraining", "documented_order", "read_windows"]

_HEADER_DTYPE = np.dtype("<u4")


@dataclass(frozen=True)
class StreamedTraining:
    """What a reader of the shard files needs to know of how a data module streams its training split: its sources
    (``{prepared directory: weight}``), its windows and batches, and whether it reads the files in the documented
    order (no shuffle, one source, no loader workers: their order is the loader's own)."""

    sources: dict[str, float]
    seq_len: int
    batch_size: int
    in_documented_order: bool

    def windows(self) -> dict[str, ShardWindows]:
        """The training windows of each source, read from its files."""
        return {directory: read_windows(directory, "train", self.seq_len) for directory in self.sources}


@dataclass(frozen=True)
class ShardWindows:
    """The windows of one split, file by file (``files[i]``: a ``(windows, seq_len + 1)`` array, memory-mapped),
    numbered 0, 1, ... in file order."""

    files: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return sum(len(windows) for windows in self.files)

    def __iter__(self) -> Iterator[np.ndarray]:
        for windows in self.files:
            yield from windows

    def take(self, numbers: list[int]) -> np.ndarray:
        """The windows numbered ``numbers``, as int64 rows."""
        starts = np.cumsum([0] + [len(windows) for windows in self.files])
        rows = []
        for number in numbers:
            file = int(np.searchsorted(starts, number, side="right")) - 1
            rows.append(self.files[file][number - starts[file]])
        return np.stack(rows).astype(np.int64)


def read_windows(prepared_dir: str, split: str, seq_len: int) -> ShardWindows:
    """The windows of ``seq_len + 1`` tokens of ``split`` (``"train"``, ``"val"``) of the directory a ``prepare``
    wrote; ``ValueError`` naming the file whose bytes do not add up to what its header and index say."""
    root = _local(prepared_dir)
    with open(os.path.join(root, "prepared.json")) as file:
        dtype = np.dtype(json.load(file)["dtype"]).newbyteorder("<")
    split_dir = os.path.join(root, split)
    with open(os.path.join(split_dir, "index.json")) as file:
        chunks = json.load(file)["chunks"]
    return ShardWindows(tuple(_file_windows(os.path.join(split_dir, chunk["filename"]), dtype, seq_len)
                              for chunk in chunks))


def _local(directory: str) -> str:
    if directory.startswith("local:"):
        return directory.removeprefix("local:")
    if "://" in directory:
        raise ValueError(f"{directory!r} is in an object store: the shard files are read here from a local "
                         "directory; copy it to one (a local copy reads the same windows)")
    return directory


def _file_windows(path: str, dtype: np.dtype, seq_len: int) -> np.ndarray:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    items = int(data[:_HEADER_DTYPE.itemsize].view(_HEADER_DTYPE)[0])
    header_bytes = (items + 2) * _HEADER_DTYPE.itemsize
    offsets = data[_HEADER_DTYPE.itemsize:header_bytes].view(_HEADER_DTYPE)
    # The header must describe exactly this file: items back to back from the header's end to the file's end.
    if offsets[0] != header_bytes or offsets[-1] != len(data) or np.any(np.diff(offsets.astype(np.int64)) < 0) \
            or (len(data) - header_bytes) % dtype.itemsize:
        raise ValueError(f"the shard {path!r} is not a token shard of {dtype.name} items: its header of {items} items "
                         f"does not describe its {len(data)} bytes")
    tokens = data[header_bytes:].view(dtype)
    window = seq_len + 1
    whole = len(tokens) // window
    return tokens[:whole * window].reshape(whole, window)


def documented_order(windows: int, replicas: int, batch_size: int) -> list[list[int]]:
    """The global batches of one epoch without shuffling, as window numbers: the windows in file order, cut to a
    whole number of global batches (``replicas x batch_size``), replica ``r`` reading the ``r``-th of ``replicas``
    equal contiguous ranges in order, ``batch_size`` a batch; global batch ``g`` is the replicas' ``g``-th batches
    joined in replica order."""
    per_replica = windows // (replicas * batch_size) * batch_size
    return [[replica * per_replica + step * batch_size + row for replica in range(replicas)
             for row in range(batch_size)] for step in range(per_replica // batch_size)]
