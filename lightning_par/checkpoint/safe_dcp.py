"""Reading a ``torch.distributed.checkpoint`` directory without running pickled code.

DCP pickles two things: its ``.metadata`` index (``FileSystemReader.read_metadata`` calls ``pickle.load``) and
every non-tensor entry of the state dict (``DefaultLoadPlanner.load_bytes`` calls ``torch.load`` with
``weights_only=False``). A pickle can name any importable callable, so a directory from an untrusted source could run
code the moment it is opened. Through DCP's own extension points this module closes both:

- :class:`SafeFileSystemReader` (:class:`SafeFsspecReader` on an object store) unpickles ``.metadata`` with an
  unpickler that constructs only the classes DCP's index is made of (its metadata dataclasses, ``torch.Size``, dtypes
  and layouts, paths);
- :class:`SafeLoadPlanner` loads non-tensor entries with ``torch.load(weights_only=True)``.

Tensors are already read with ``weights_only=True`` by DCP. Anything else is refused with
:class:`PickledCodeError`, which names the class met; ``weights_only=False`` (a strategy's
``checkpoint_weights_only=False``, ``lightning-par-export --trust-pickled-code``) is the only way back to DCP's own
reader and planner. No lightning import (docs/architecture.md).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from lightning_par.checkpoint.object_store import Location, is_object_store

__all__ = ["PickledCodeError", "SafeFileSystemReader", "SafeFsspecReader", "SafeLoadPlanner", "storage_reader",
           "load_planner", "load_object", "safe_globals", "refused_class"]


class PickledCodeError(pickle.UnpicklingError):
    """A pickle that names a class or function outside what a checkpoint is made of (``found``: ``module.name``)."""

    def __init__(self, found: str) -> None:
        super().__init__(f"refused to construct {found}")
        self.found = found


def _index_classes() -> dict[tuple[str, str], Any]:
    """{(module, name): object} of everything DCP's ``.metadata`` pickles: the classes defined in
    ``torch.distributed.checkpoint.metadata`` (whichever this torch has), the file reader's ``_StorageInfo``, and the
    torch and standard-library types their fields hold."""
    allowed: list[Any] = [value for value in vars(dcp_metadata).values()
                          if isinstance(value, type) and value.__module__ == dcp_metadata.__name__]
    allowed += [_StorageInfo, torch.Size, torch.serialization._get_layout, pathlib.PosixPath, pathlib.WindowsPath,
                pathlib.PurePosixPath, pathlib.PureWindowsPath, set, frozenset]
    found = {(value.__module__, value.__qualname__): value for value in allowed}
    # a path pickled by a Python whose pathlib classes live in another module (3.13's pathlib._local)
    found.update({("pathlib", path.__name__): path for path in allowed if path.__module__.startswith("pathlib")})
    # dtypes (float8 ones included), layouts and memory formats pickle as attributes of torch
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[("torch", name)] = value
    return found


_INDEX_CLASSES = _index_classes()


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _INDEX_CLASSES[(module, name)]
        except KeyError:
            raise PickledCodeError(f"{module}.{name}") from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` constructs only the classes of DCP's index."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _IndexUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise PickledCodeError(f"{type(metadata).__module__}.{type(metadata).__qualname__} (not DCP's Metadata)")
        # what FileSystemReader.read_metadata does after unpickling
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFsspecReader(FsspecReader):
    """``FsspecReader`` (a directory on an object store) whose ``read_metadata`` constructs only the classes of DCP's
    index."""

    read_metadata = SafeFileSystemReader.read_metadata


def safe_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` admits beyond tensors and builtins in a checkpoint's non-tensor
    entries: the NumPy types of an RNG state (``np.random.get_state()``: an array and its dtype)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # NumPy 2 / 1
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar,
            *{type(np.dtype(t)) for t in (np.uint32, np.int32, np.int64, np.float32, np.float64, np.bool_)}]


def load_object(source: str | os.PathLike | io.BytesIO) -> Any:
    """``torch.load(weights_only=True)`` of ``source`` with :func:`safe_globals` admitted; what it refuses raises
    :class:`PickledCodeError` naming the class."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise
        found = "a Python object"
        if "Unsupported global: GLOBAL " in str(error):
            found = str(error).split("Unsupported global: GLOBAL ")[-1].split(" ")[0]
        raise PickledCodeError(found) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries with ``weights_only=True`` (:func:`load_object`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_object(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def refused_class(error: BaseException) -> str | None:
    """The class a :class:`PickledCodeError` refused, if ``error`` is one or a DCP ``CheckpointException`` that
    wraps one on some rank (DCP gathers every rank's read failures), else None."""
    if isinstance(error, PickledCodeError):
        return error.found
    for failure in getattr(error, "failures", {}).values():
        wrapped = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(wrapped, PickledCodeError):
            return wrapped.found
    return None


def storage_reader(path: str | os.PathLike | Location, weights_only: bool | None = None) -> StorageReader:
    """The reader of a DCP directory, on disk or on an object store: :class:`SafeFileSystemReader` or
    :class:`SafeFsspecReader` unless ``weights_only=False`` trusts it."""
    if is_object_store(path):
        return FsspecReader(str(path)) if weights_only is False else SafeFsspecReader(str(path))
    return FileSystemReader(path) if weights_only is False else SafeFileSystemReader(path)


def load_planner(weights_only: bool | None = None) -> LoadPlanner:
    """The load planner: :class:`SafeLoadPlanner` unless ``weights_only=False`` trusts the directory."""
    return DefaultLoadPlanner() if weights_only is False else SafeLoadPlanner()
