"""Putting a written checkpoint in place so that its name never points at nothing or at half a checkpoint.

A checkpoint is written under :data:`STAGING_DIR` beside its final name, then moved in by :func:`move_into_place`:
one rename for a file, one ``renameat2(RENAME_EXCHANGE)`` swap for a sharded checkpoint's directory (a directory
cannot be renamed over another). Where the filesystem cannot swap, the old copy is moved aside first;
:func:`interrupted_replacements` finds both copies again if a crash comes between the two renames, and
:func:`clear_staging` finishes such a replacement before the name is written again (docs/checkpoints.md, "Atomic
saves"). On an object store, where nothing can be renamed, :mod:`lightning_par.checkpoint.object_store` commits
instead, with the same guarantees.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import shutil
from pathlib import Path
from typing import Any

from lightning_par.checkpoint import object_store
from lightning_par.checkpoint.object_store import Location

# Beside the checkpoints, under a name no checkpoint scanner matches: ModelCheckpoint looks for ``last*.ckpt``
# and Lightning's SLURM resume for any name containing ``hpc_ckpt_``, so ``.hpc_ckpt_3.ckpt.partial`` would
# be taken for version 3. Same directory, same filesystem: the final rename stays atomic.
STAGING_DIR = ".lightning_par-staging"
RETIRED_SUFFIX = ".old"  # an old copy moved aside by a save on a filesystem that cannot swap


def staging_path(final: Location) -> Location:
    """Where ``final`` is written before it is renamed into place (never loaded, cleaned by the next save)."""
    return final.parent / STAGING_DIR / final.name


def clear_staging(final: Location) -> None:
    """Make room to write ``final`` again in the staging folder: a replacement a crash cut between its two renames is
    finished first (the staged copy, complete, goes to ``final``; without one, the old copy goes back), so that what
    :func:`interrupted_replacements` took stays the newest complete copy; then what is left staged is removed."""
    staging = staging_path(final)
    if object_store.is_object_store(final):
        object_store.clear_staging(staging, final)
        return
    retired = staging.with_name(f"{final.name}{RETIRED_SUFFIX}")
    if retired.exists() and not final.exists():
        os.replace(staging if staging.exists() else retired, final)
    remove(retired)
    remove(staging)  # left behind by a crash while it was written: never complete, never loaded


def move_into_place(staging: Location, final: Location) -> None:
    """Put the complete checkpoint ``staging`` at ``final`` so that at no moment is ``final`` missing or incomplete.

    A file over a file, or onto a free name, is one rename. Anything else is swapped with ``final`` in one
    ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15 and later, local filesystems), and the old copy, now in the staging
    folder, is removed. Where the filesystem cannot swap, the old copy is moved aside to ``<staging>.old`` first; a
    crash between that rename and the next leaves no ``final``, and :func:`interrupted_replacements` finds both
    copies. On an object store: :func:`lightning_par.checkpoint.object_store.commit`."""
    if object_store.is_object_store(final):
        object_store.commit(staging, final)
        return
    if not final.exists() or (final.is_file() and staging.is_file()):
        os.replace(staging, final)  # atomic over an existing file on POSIX
    elif exchange(staging, final):
        remove(staging)
    else:
        retired = staging.with_name(f"{final.name}{RETIRED_SUFFIX}")
        remove(retired)
        os.replace(final, retired)
        os.replace(staging, final)
        remove(retired)
    try:
        staging.parent.rmdir()  # only when no other save is staged there
    except OSError:
        pass


def interrupted_replacements(folder: Location) -> list[Location]:
    """The checkpoints of ``folder`` whose replacement a crash cut between its two renames (a filesystem that cannot
    swap): for each ``<name>.old`` of the staging folder whose ``<name>`` is missing from ``folder``, the new copy
    staged as ``<name>`` (complete: it is only moved once written) and the old one. Both were complete; the caller
    picks the newest that loads. On an object store, the whole staged copies whose commit a crash cut short
    (:func:`lightning_par.checkpoint.object_store.interrupted_commits`)."""
    staged = folder / STAGING_DIR
    if object_store.is_object_store(folder):
        return object_store.interrupted_commits(staged, folder)
    if not staged.is_dir():
        return []
    found = []
    for retired in staged.glob(f"*{RETIRED_SUFFIX}"):
        name = retired.name[: -len(RETIRED_SUFFIX)]
        if not (folder / name).exists():
            found += [path for path in (staged / name, retired) if path.exists()]
    return found


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100  # paths relative to the working directory, as os.replace takes them


def exchange(first: Path, second: Path) -> bool:
    """Swap what the two paths name, atomically; False where the system or the filesystem cannot (not Linux, an old
    kernel or C library, a filesystem without ``RENAME_EXCHANGE``)."""
    rename = _renameat2()
    if rename is None:
        return False
    if rename(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


@functools.cache
def _renameat2() -> Any:
    """The C library's ``renameat2``, or None where it has none."""
    rename = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), "renameat2", None)
    if rename is not None:
        rename.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return rename


def remove(path: Location) -> None:
    """Remove ``path``, a file or a directory, if it exists."""
    if object_store.is_object_store(path):
        object_store.remove(path)
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
