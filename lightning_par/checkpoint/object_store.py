"""Checkpoints on object stores: ``s3://bucket/run`` and any other fsspec URL, with the guarantees of local disk.

A checkpoint's location is a :class:`pathlib.Path` on local disk and a ``universal_pathlib`` ``UPath`` (the same API
over fsspec) for a URL (:func:`location`), so that the code that writes, checks and reads checkpoints is one. What an
object store lacks is a rename: an object is copied, and a folder is only a prefix of object names. Putting a staged
checkpoint in place (:func:`commit`) is then done so that no name ever shows a checkpoint that is not whole:

- a file (the full format) is one object: copied to its name in one server-side copy, which appears whole or not at
  all, then the staged object deleted;
- a sharded checkpoint is complete when its DCP index ``.metadata`` exists: DCP writes it once every rank has written
  its shards, and the commit copies it last. An old copy under the name loses its ``.metadata`` first (from then on
  it is incomplete, never loaded), then its other objects; the staged objects are copied, ``.metadata`` last, and the
  staged copy deleted. A crash in between leaves the staged copy whole, and :func:`interrupted_commits` finds it for
  ``ckpt_path="auto"``, as ``lightning_par.checkpoint.atomic.interrupted_replacements`` does on a filesystem that
  cannot swap; the next save of the name finishes the commit before it writes (:func:`clear_staging`).

Listings are never cached (other ranks and processes write). Credentials and endpoints are fsspec's (for S3, s3fs
reads ``AWS_*`` variables, ``AWS_ENDPOINT_URL`` included). No lightning import (docs/architecture.md).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from upath import UPath

    Location = Path | UPath
else:
    Location = Any

DCP_INDEX = ".metadata"  # what torch.distributed.checkpoint writes last, naming every file and tensor
_LOCAL_PROTOCOLS = ("", "file", "local")

__all__ = ["Location", "location", "is_object_store", "commit", "clear_staging", "interrupted_commits", "remove",
           "written_at", "readable"]


def location(path: str | os.PathLike | Location) -> Location:
    """``path`` as a :class:`pathlib.Path` (local, ``file://`` included) or, for another protocol's URL, as a
    ``UPath`` whose listings are not cached."""
    if isinstance(path, Path) or is_object_store(path):
        return path
    text = os.fspath(path)
    protocol, separator, rest = text.partition("://")
    if not separator:
        return Path(text)
    if protocol in _LOCAL_PROTOCOLS:
        return Path(rest)
    try:
        from upath import UPath
    except ImportError:
        raise ImportError(f"{text!r} is on an object store: install lightning-par[remote] (universal_pathlib, and the "
                          f"fsspec package for {protocol}://, s3fs for s3://)") from None
    return UPath(text, use_listings_cache=False)


def is_object_store(path: Any) -> bool:
    """Whether ``path`` is a location on an object store (a ``UPath`` of a remote protocol)."""
    return getattr(path, "protocol", None) not in (None, *_LOCAL_PROTOCOLS)


def commit(staging: Location, final: Location) -> None:
    """Put the complete checkpoint ``staging`` at ``final`` on an object store (module docstring)."""
    fs = final.fs
    if not staging.is_dir():
        fs.copy(staging.path, final.path)
        fs.rm(staging.path)
        return
    if (final / DCP_INDEX).exists():
        fs.rm((final / DCP_INDEX).path)  # from here on the old copy is incomplete: never loaded
    if final.exists():
        fs.rm(final.path, recursive=True)
    names = sorted(_relative_names(staging), key=lambda name: name == DCP_INDEX)  # the index last
    for name in names:
        fs.copy((staging / name).path, (final / name).path)
    fs.rm(staging.path, recursive=True)


def clear_staging(staging: Location, final: Location) -> None:
    """Make room to stage ``final`` again: a commit a crash cut short (a whole staged copy, no whole ``final``) is
    finished first, then what is left staged is removed."""
    if (staging / DCP_INDEX).exists() and not (final / DCP_INDEX).exists():
        commit(staging, final)
    remove(staging)


def interrupted_commits(staging_folder: Location, folder: Location) -> list[Location]:
    """The whole staged sharded checkpoints of ``staging_folder`` whose commit to ``folder`` a crash cut short."""
    if not staging_folder.is_dir():
        return []
    return [staged for staged in staging_folder.iterdir()
            if (staged / DCP_INDEX).exists() and not (folder / staged.name / DCP_INDEX).exists()]


def remove(path: Location) -> None:
    """Remove the object or every object under the prefix ``path``, if any."""
    if path.exists():
        path.fs.rm(path.path, recursive=path.is_dir())


def written_at(path: Location) -> float:
    """When ``path`` was last written (seconds): a prefix by its newest object."""
    fs = path.fs
    infos = fs.find(path.path, detail=True).values() if path.is_dir() else [fs.info(path.path)]
    # S3's listing says when each object was written; other stores are asked
    return max(((info.get("LastModified") or fs.modified(info["name"])).timestamp() for info in infos), default=0.0)


def readable(path: Location) -> Path | io.BytesIO:
    """What ``torch.load`` reads ``path`` from: the path itself on local disk, the object's bytes from a store."""
    return io.BytesIO(path.read_bytes()) if is_object_store(path) else path


def _relative_names(folder: Location) -> list[str]:
    """The names of every object under ``folder``, relative to it."""
    root = folder.path.rstrip("/") + "/"
    return [name[len(root):] for name in folder.fs.find(folder.path)]
