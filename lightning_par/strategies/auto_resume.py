"""``ckpt_path="auto"``: resume from the newest complete checkpoint of the run when there is one, else start afresh.

One setting for the first start and for every restart, which is what a launcher that restarts a failed job
(``torchrun --max-restarts``, a SLURM requeue, a Kubernetes restart policy) needs: the same command line each time.
Lightning's ``"last"`` looks only at ``last*.ckpt``; ``"auto"`` takes any checkpoint the run's ``ModelCheckpoint``
callbacks write (``epoch=E-step=S.ckpt``, ``last.ckpt``) and Lightning's HPC checkpoints (``hpc_ckpt_N.ckpt``), and
passes over one that cannot be loaded (``lightning_par.checkpoint.format.checkpoint_problem``): a save that was cut off
leaves only its staging directory, which is not looked at, and a file truncated by other means is skipped with a
warning. A checkpoint is replaced in one atomic swap; on a filesystem that cannot swap, a crash between the two renames
that replace it leaves both copies in the staging directory, and ``"auto"`` takes them
(``lightning_par.checkpoint.atomic.interrupted_replacements``). Newest is the latest written. With a logger that
numbers its versions, the run's checkpoint directory
moves to a new ``version_N`` at each start, so the earlier versions' ``checkpoints`` directories are looked in
too. Every rank decides by itself, before the processes connect, so the checkpoint directory must be one that every
node sees (as for any resume): a shared filesystem, or an object store (``s3://``; there a sharded checkpoint counts
as complete with its DCP index, ``lightning_par/checkpoint/object_store.py``).

Installed into Lightning's checkpoint connector (its private ``_parse_ckpt_path``) when ``lightning_par`` is imported:
``Trainer.fit(ckpt_path="auto")`` and ``lightning-par fit --ckpt_path auto`` both work, with any strategy; any other
value goes to Lightning's own unchanged. :func:`uninstall` gives Lightning its own back.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par.checkpoint import object_store
from lightning_par.checkpoint.atomic import interrupted_replacements
from lightning_par.checkpoint.format import META_FILE, checkpoint_problem, read_metadata
from lightning_par.checkpoint.object_store import Location, location

AUTO = "auto"

__all__ = ["AUTO", "install", "newest_checkpoint", "uninstall"]


def newest_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint of ``trainer``'s run that can be loaded, or None. One process, no collective."""
    candidates: set[Location] = set()
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        directory = location(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))  # where it saves, as it decides
        folders = [directory]
        if callback.dirpath is None and trainer.loggers and not isinstance(trainer.loggers[0].version, str):
            folders += directory.parent.parent.glob("version_*/checkpoints")  # the run's earlier starts
        for folder in folders:
            candidates |= set(folder.glob(f"*{callback.FILE_EXTENSION}")) | set(interrupted_replacements(folder))
    hpc = trainer._checkpoint_connector._hpc_resume_path
    if hpc is not None:
        candidates.add(location(hpc))
    for path in sorted(candidates, key=_newest, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        rank_zero_warn(f'ckpt_path="auto" passes over {str(path)!r}: {problem}')
    return None


def _newest(path: Location) -> tuple[float, int]:
    """When ``path`` was last written, then, on an object store (whose clock counts seconds, so that several saves
    can share one), the step of a sharded checkpoint (its small ``meta.pt``; a full one would be read whole)."""
    if not object_store.is_object_store(path):
        return _written_at(path), 0
    step = 0
    if (path / META_FILE).exists():
        try:
            step = read_metadata(path / META_FILE).get("global_step", 0)
        except Exception:  # noqa: BLE001 - one that cannot be read is passed over below, with its reason
            step = -1
    return object_store.written_at(path), step


def _written_at(path: Path) -> int:
    """When ``path`` was last written: a sharded checkpoint's directory by the newest file in it."""
    if path.is_dir():
        return max((entry.stat().st_mtime_ns for entry in os.scandir(path)), default=path.stat().st_mtime_ns)
    return path.stat().st_mtime_ns


def _with_auto(parse: Any) -> Any:
    @functools.wraps(parse)
    def parse_ckpt_path(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        if ckpt_path != AUTO:
            return parse(self, state_fn, ckpt_path, *args, **kwargs)
        found = newest_checkpoint(self.trainer)
        rank_zero_info(f'ckpt_path="auto": resuming from {found}' if found is not None else
                       'ckpt_path="auto": no checkpoint of this run yet, starting afresh')
        return found

    parse_ckpt_path.lightning_par_auto = True  # type: ignore[attr-defined]
    return parse_ckpt_path


def install() -> None:
    """Teach Lightning's checkpoint connector ``ckpt_path="auto"`` (once)."""
    if not getattr(_CheckpointConnector._parse_ckpt_path, "lightning_par_auto", False):
        _CheckpointConnector._parse_ckpt_path = _with_auto(_CheckpointConnector._parse_ckpt_path)


def uninstall() -> None:
    """Give Lightning's checkpoint connector its own ``_parse_ckpt_path`` back (``"auto"`` is then a file name)."""
    if getattr(_CheckpointConnector._parse_ckpt_path, "lightning_par_auto", False):
        _CheckpointConnector._parse_ckpt_path = _CheckpointConnector._parse_ckpt_path.__wrapped__
