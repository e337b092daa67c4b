"""What is wrong with a checkpoint, found before any rank loads a tensor from it.

A checkpoint that cannot be loaded should fail with one line that names the path, the cause and what to do,
not with whatever the unpickler or DCP's reader meets first (``invalid literal for int()``, a bare
``CheckpointException``). The checks here only read what is cheap: the first bytes of a file, DCP's
``.metadata`` index and the sizes of the files it names; a full checkpoint is checked on the dict that
``torch.load`` returned. :func:`agree` makes every rank raise the same :class:`CheckpointError` (the first
rank's problem, in rank order), so no rank goes on into a collective its peers will never join.

No lightning import (docs/architecture.md).
"""

from __future__ import annotations

import zipfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_par.checkpoint import safe_dcp
from lightning_par.checkpoint.object_store import DCP_INDEX, Location

__all__ = ["CheckpointError", "FORMAT", "FORMAT_KEY", "agree", "file_problem", "sharded_problem", "model_problem",
           "pickled_code_problem", "one_line"]

# The layout of what lightning-par writes beside Lightning's own keys. A reader refuses a higher number with
# a message instead of misreading it; raise it when a change would make older readers load something wrong.
FORMAT = 1
FORMAT_KEY = "lightning_par_checkpoint_format"
_MODEL_PREFIX = "state_dict."
_SHOWN = 3  # mismatching names shown in a message


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run: the message names the path, the cause and the fix."""


def file_problem(path: Location) -> str | None:
    """Why the file at ``path`` is not a checkpoint ``torch.load`` can read, or None if it looks like one."""
    size = path.stat().st_size
    with path.open("rb") as stream:  # on disk or on an object store
        head = stream.read(8)
        zipped = head[:4] == b"PK\x03\x04"  # torch.save's zip archive: its index sits at the end of the file
        if zipped and not zipfile.is_zipfile(stream):
            return (f"checkpoint {str(path)!r} is truncated or corrupt: the archive's index at its end is missing "
                    f"({size} bytes), so it was not written completely; load an earlier checkpoint")
    if zipped or head[:1] == b"\x80":  # or a pickle: torch.save's legacy format
        return None
    return (f"{str(path)!r} is not a checkpoint: it is neither a directory written by torch.distributed.checkpoint "
            f"nor a file written by torch.save (it starts with {head!r}, {size} bytes); give the path of a .ckpt "
            "file or directory that Lightning or lightning-par wrote")


def sharded_problem(path: Location, *, meta_file: str,
                    weights_only: bool | None = None) -> tuple[str | None, Metadata | None]:
    """Why the directory ``path`` is not a complete sharded checkpoint (None if it is), and its DCP index (read by
    :mod:`lightning_par.checkpoint.safe_dcp` unless ``weights_only=False`` trusts the directory)."""
    if not (path / DCP_INDEX).is_file():
        found = sorted(p.name for p in path.iterdir())[:5]
        return (f"{str(path)!r} is a directory but not a sharded checkpoint: it has no .metadata (the index "
                "torch.distributed.checkpoint writes last) and holds " + (", ".join(found) if found else "nothing")
                + "; it was not written completely, or is not a checkpoint"), None
    if not (path / meta_file).is_file():
        return (f"sharded checkpoint {str(path)!r} has no {meta_file} (the loops, schedulers and hyper-parameters "
                "rank 0 writes): it is incomplete, or was not written by lightning-par; copy the whole "
                "directory, or load an earlier checkpoint"), None
    try:
        metadata = safe_dcp.storage_reader(path, weights_only).read_metadata()
    except safe_dcp.PickledCodeError as error:
        return pickled_code_problem(path / DCP_INDEX, error.found), None
    except Exception as error:  # noqa: BLE001 - any failure to read the index is the cause to report
        return (f"sharded checkpoint {str(path)!r}: its .metadata index cannot be read ({one_line(error)}); "
                "it is corrupt: load an earlier checkpoint"), None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, least in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return (f"sharded checkpoint {str(path)!r} is missing the shard {name!r} that its index names: "
                    "copy the whole directory, or load an earlier checkpoint"), metadata
        if shard.stat().st_size < least:
            return (f"sharded checkpoint {str(path)!r}: the shard {name!r} is truncated ({shard.stat().st_size} "
                    f"bytes, its index needs {least}); load an earlier checkpoint"), metadata
    return None, metadata


def pickled_code_problem(path: Location, found: str) -> str:
    """The refusal of a checkpoint file whose pickle names ``found``, a class outside what a checkpoint is made of."""
    return (f"checkpoint {str(path)!r} holds {found}, which unpickling would have to construct and which can run "
            "code: it was not loaded. If you trust the file's source, load it with weights_only=False (the "
            "strategy's checkpoint_weights_only=False; lightning-par-export --trust-pickled-code)")


def saved_shapes(metadata: Metadata, prefix: str = _MODEL_PREFIX) -> dict[str, tuple[int, ...] | None]:
    """{parameter name: global shape} of the model weights in a DCP index, the names under ``prefix`` (a
    sharded checkpoint's ``state_dict.``; none in a Hugging Face directory); None for non-tensors."""
    return {key[len(prefix):]: (tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None)
            for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}


def dtype_problem(path: Location, metadata: Metadata, state: dict[str, Any], *, prefix: str = _MODEL_PREFIX,
                  what: str = "checkpoint") -> str | None:
    """Why tensors saved in ``metadata`` cannot be copied into this rank's floating-point ``state`` by value: saved
    as integers or booleans (quantized weights), they would be converted silently into meaningless numbers."""
    for name, value in state.items():
        entry = metadata.state_dict_metadata.get(prefix + name)
        if not isinstance(value, torch.Tensor) or not isinstance(entry, TensorStorageMetadata):
            continue
        saved = entry.properties.dtype
        if value.is_floating_point() and not (saved.is_floating_point or saved.is_complex):
            return (f"{what} {str(path)!r} stores {name} as {saved}, and the model's parameter is {value.dtype}: "
                    "quantized or integer weights would be converted into meaningless values; give a directory of "
                    "floating-point weights (dequantize it first)")
    return None


def saved_optimizers(metadata: Metadata) -> int:
    """How many optimizers' states a sharded checkpoint holds (``optimizer_0``, ``optimizer_1``, ...)."""
    indices = {key.split(".", 1)[0] for key in metadata.state_dict_metadata if key.startswith("optimizer_")}
    return len(indices)


def model_problem(path: Location, saved: dict[str, tuple[int, ...] | None], expected: dict[str, tuple[int, ...]],
                  *, strict: bool, what: str = "checkpoint") -> str | None:
    """Why weights of ``saved`` shapes do not load into a model of ``expected`` shapes (by name), or None.
    ``what`` the weights are (a checkpoint, a model directory), for the message."""
    if expected and not saved:
        return (f"{what} {str(path)!r} holds no model weights under 'state_dict': it was not written by "
                "Lightning or lightning-par (or only holds other state)")
    differ = [f"{name} is {tuple(saved[name])} there and {shape} here" for name, shape in expected.items()
              if saved.get(name) is not None and tuple(saved[name]) != shape]
    missing = [name for name in expected if name not in saved] if strict else []
    if not differ and not missing:
        return None
    parts = differ[:_SHOWN]
    if missing:
        parts.append(f"{len(missing)} of this model's names are not in it ({', '.join(missing[:_SHOWN])}"
                     f"{', ...' if len(missing) > _SHOWN else ''})")
        extra = [name for name in saved if name not in expected]
        if extra:
            parts.append(f"it has {len(extra)} names this model lacks ({', '.join(extra[:_SHOWN])}"
                         f"{', ...' if len(extra) > _SHOWN else ''})")
    more = f" and {len(differ) - _SHOWN} more shapes differ" if len(differ) > _SHOWN else ""
    return (f"{what} {str(path)!r} was written by another model: {'; '.join(parts)}{more}. Build the model with "
            "the hyper-parameters it was trained with" + ("" if not missing else
                                                          ", or load with strict_loading=False to skip missing names"))


def format_problem(path: Location, checkpoint: dict[str, Any]) -> str | None:
    """Why a checkpoint written by another lightning-par version cannot be read by this one, or None."""
    written = checkpoint.get(FORMAT_KEY, FORMAT)
    if isinstance(written, int) and written > FORMAT:
        return (f"checkpoint {str(path)!r} was written by a newer lightning-par (checkpoint format {written}; this "
                f"version reads format {FORMAT} and older): upgrade lightning-par to load it")
    return None


def optimizer_problem(path: Location, saved: int, wanted: int) -> str | None:
    if wanted and saved == 0:
        return (f"checkpoint {str(path)!r} holds the model but no optimizer state (saved with "
                "ModelCheckpoint(save_weights_only=True)?): training cannot resume from it; load its weights into "
                "the model before fit instead (lightning-par-export writes them as one file)")
    if wanted and saved != wanted:
        return (f"checkpoint {str(path)!r} has {saved} optimizer states and the model configures {wanted} "
                "optimizers: configure_optimizers must return as many as when it was saved")
    return None


def expected_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{name: global shape} of every tensor of the model on every rank (pipeline ranks hold different ones).
    Collective when a process group is up."""
    mine = {name: tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {name: shape for part in parts for name, shape in part.items()}


def agree(problem: str | None) -> None:
    """Raise :class:`CheckpointError` on every rank if any rank found a problem (the first, in rank order).
    Collective when a process group is up."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise CheckpointError(problem)


def one_line(error: BaseException) -> str:
    """An error as one line; a ``CheckpointException`` as each failing rank's own error."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {one_line(wrapped[0] if isinstance(wrapped, tuple) else wrapped)}"
                         for rank, wrapped in sorted(error.failures.items()))
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
