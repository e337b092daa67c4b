"""Checkpoints for every layout, on PyTorch Distributed Checkpoint (DCP).

Two formats, both written atomically (a checkpoint is staged beside its final name and renamed into
place only when every rank has finished, so a crash mid-save never leaves something that looks whole):

- sharded (default): a directory. Every rank writes the tensors it owns through
  ``torch.distributed.checkpoint`` (replicated tensors once), rank 0 adds ``meta.pt`` with the rest of
  Lightning's checkpoint (loops, schedulers, hyper-parameters). Because DCP stores tensors by fully
  qualified name and global shape, a sharded checkpoint can be loaded under another layout.
- full: one ``torch.save`` file written by rank 0 holding whole tensors, loadable by plain PyTorch.

The functions here are collectives: every rank calls them. No lightning import (docs/architecture.md).
"""

from __future__ import annotations

import os
import pickle
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch import Tensor, nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_par.checkpoint import validation
from lightning_par.checkpoint.atomic import STAGING_DIR, clear_staging, move_into_place, remove, staging_path
from lightning_par.checkpoint import safe_dcp
from lightning_par.checkpoint.object_store import Location, is_object_store, location, readable
from lightning_par.parallel.modules import clean_name, tied_aliases
from lightning_par.parallel.regroup import optimizer_to_stored_order, optimizer_to_training_order
from lightning_par.parallel.zero_experts import ZeroWithExperts

MODEL_KEY = "state_dict"  # Lightning's own key for the model weights
# {alias: name} of tied parameters (a head tied to the embedding): saved once under the first name, restored on
# load and on export.
TIED_KEY = "lightning_par_tied_parameters"
# In a checkpoint of a module whose frozen parameters come from a model directory (HFCausalLM with LoRA): that
# directory, as lightning_par.checkpoint.adapters.base_reference gives it. The checkpoint holds the trainable parameters only.
FROZEN_BASE_KEY = "lightning_par_frozen_base"
# In a checkpoint written under Lightning Fabric: which entries of the state saved held the model and the optimizers
# (the checkpoint keeps them under MODEL_KEY and OPTIMIZERS_KEY, as the Trainer's).
FABRIC_KEY = "lightning_par_fabric_state"
OPTIMIZERS_KEY = "optimizer_states"  # Lightning's own key: a list, one entry per optimizer
META_FILE = "meta.pt"


def model_state_dict(module: nn.Module, *, full: bool, aliases: bool = True,
                     trainable_only: bool = False) -> dict[str, Any]:
    """The model's state by fully qualified name: this rank's shards, or with ``full`` whole tensors on CPU
    gathered to rank 0 (the other ranks get an empty dict). ``aliases=False`` leaves out the other names of a
    tied parameter, so that a checkpoint holds it once; ``trainable_only`` keeps the parameters that require a
    gradient (a LoRA run's adapters: its frozen base is read from the model directory again)."""
    # Fused projections regrouped for tensor parallel come in the model's order (their state_dict hooks: regroup.py).
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    if not aliases:
        for alias in tied_aliases(module):
            state.pop(alias, None)
    if trainable_only:
        trainable = trainable_names(module)
        state = {name: value for name, value in state.items() if name in trainable}
    return state


def trainable_names(module: nn.Module) -> set[str]:
    """The state-dict names of the parameters of ``module`` that require a gradient."""
    return {clean_name(name) for name, parameter in module.named_parameters(remove_duplicate=False)
            if parameter.requires_grad}


def with_aliases(state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``state`` with every alias of a tied parameter pointing at its first name's tensor (the same object)."""
    return {**state, **{alias: state[name] for alias, name in aliases.items() if name in state}}


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (not by position), so it survives re-wrapping.

    A ``ZeroRedundancyOptimizer`` (ZeRO-1/2) gives this rank's part of the same format: the states of
    the parameters it owns (names are disjoint across its ranks, so a sharded save needs no gathering
    and a load under another partition finds each name wherever it was saved) and the hyper-parameters
    of every group, which all ranks share. For a full save the parts are gathered.
    """
    options = StateDictOptions(full_state_dict=full, cpu_offload=True)
    if isinstance(optimizer, ZeroWithExperts):  # its parts' states, names disjoint; its groups are the user's
        parts = [optimizer_state_dict(module, part, full=full) for part in optimizer.parts]
        return {"state": {name: value for part in parts for name, value in part["state"].items()},
                "param_groups": _named_groups(module, optimizer.param_groups)}
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer_to_stored_order(module, get_optimizer_state_dict(module, optimizer, options=options))
    local = optimizer_to_stored_order(module, _zero_optimizer_state(module, optimizer, full=full))
    if not full:
        return local
    parts: list[Any] = [None] * dist.get_world_size(optimizer.process_group)
    dist.all_gather_object(parts, local["state"], group=optimizer.process_group)
    return {"state": {name: value for part in parts for name, value in part.items()},
            "param_groups": local["param_groups"]}


def _named_groups(module: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups``' hyper-parameters, each with its parameters' names as state dicts spell them (without the prefix
    activation-checkpoint wrappers add)."""
    names = {param: name.replace(_CHECKPOINT_PREFIX, "") for name, param in module.named_parameters()}
    return [{**_hyper_parameters(group), "params": [names[p] for p in group["params"]]} for group in groups]


def _zero_optimizer_state(module: nn.Module, optimizer: ZeroRedundancyOptimizer, *, full: bool) -> dict[str, Any]:
    # Full: the states of tensor-parallel shards made whole (the tensor-parallel peers own the same parameters, so
    # they gather together), on every rank, since each rank's part is then gathered over the data-parallel ranks.
    options = StateDictOptions(full_state_dict=True) if full else StateDictOptions(cpu_offload=True)
    owned = get_optimizer_state_dict(module, optimizer.optim, options=options)
    if full:
        owned["state"] = {name: {key: value.cpu() if torch.is_tensor(value) else value for key, value in state.items()}
                          for name, state in owned["state"].items()}
    # The exposed param_groups hold the current hyper-parameters (an LR scheduler writes there; the
    # local optimizer only sees them at its next step) and every parameter of each group.
    return {"state": owned["state"], "param_groups": _named_groups(module, optimizer.param_groups)}


def _hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _load_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any], *, full: bool) -> None:
    options = StateDictOptions(full_state_dict=full)
    if isinstance(optimizer, ZeroWithExperts):
        for index, part in enumerate(optimizer.parts):
            _load_optimizer_state(module, part, {"state": state["state"],
                                                 "param_groups": optimizer.part_groups(index, state["param_groups"])},
                                  full=full)
        for exposed, saved in zip(optimizer.param_groups, state["param_groups"]):
            exposed.update(_hyper_parameters(saved))
        return
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        set_optimizer_state_dict(module, optimizer, optimizer_to_training_order(module, state), options=options)
        return
    # Keep the states of the parameters this rank owns under the current partition.
    local_groups = get_optimizer_state_dict(module, optimizer.optim)["param_groups"]
    owned = {name for group in local_groups for name in group["params"]}
    local_state = {
        "state": {name: value for name, value in state["state"].items() if name in owned},
        "param_groups": [{**_hyper_parameters(saved), "params": local["params"]}
                         for saved, local in zip(state["param_groups"], local_groups)],
    }
    set_optimizer_state_dict(module, optimizer.optim, optimizer_to_training_order(module, local_state),
                             options=options)
    for exposed, saved in zip(optimizer.param_groups, state["param_groups"]):
        exposed.update(_hyper_parameters(saved))


def is_sharded_checkpoint(path: str | os.PathLike | Location) -> bool:
    path = location(path)
    return path.is_dir() and (path / validation.DCP_INDEX).is_file()


def save_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike | Location,
    *,
    sharded: bool,
    asynchronous: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> Future | None:
    """Write ``checkpoint`` to ``path`` atomically, on disk or on an object store (an fsspec URL such as
    ``s3://bucket/run/last.ckpt``: ``lightning_par.checkpoint.object_store``). Collective; ``path`` must be the same
    on every rank.

    ``checkpoint`` is Lightning's checkpoint dict whose ``state_dict`` / ``optimizer_states`` entries come
    from :func:`model_state_dict` / :func:`optimizer_state_dict` with ``full=not sharded``.

    ``asynchronous`` (sharded only): ``torch.distributed.checkpoint.async_save`` copies the tensors to CPU
    memory and writes them in a background thread over ``process_group`` (a gloo group of its own, so its
    collectives never interleave with training's); this returns at once with a future that completes when
    the checkpoint is in place (on rank 0, after the rename). Training must not save or load again before
    the future is done.
    """
    if asynchronous and not sharded:
        raise ValueError("asynchronous checkpoints are written by torch.distributed.checkpoint: "
                         "they need the sharded format (save_distributed_checkpoint=True)")
    checkpoint = {**checkpoint, validation.FORMAT_KEY: validation.FORMAT}
    final = location(path)
    staging = staging_path(final)
    rank = _rank()
    tensors = {}
    if sharded:
        tensors = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
        for index, state in enumerate(checkpoint.pop(OPTIMIZERS_KEY, [])):
            tensors[f"optimizer_{index}"] = state

    def prepare() -> None:
        staging.parent.mkdir(parents=True, exist_ok=True)
        clear_staging(final)
        if sharded:
            staging.mkdir()
        with (staging / META_FILE if sharded else staging).open("wb") as stream:
            torch.save(checkpoint, stream)

    try:
        on_rank_zero(prepare)
        if sharded and asynchronous:
            written = dcp.async_save(tensors, **_dcp_destination(staging), process_group=process_group)
            return _thenmove_into_place(written, staging, final, move=rank == 0)
        if sharded:
            dcp.save(tensors, **_dcp_destination(staging))
        on_rank_zero(lambda: move_into_place(staging, final))
    except (Exception, CheckpointException) as error:
        raise CheckpointSaveError(_save_failed(final, error)) from error
    return None


def _dcp_destination(staging: Location) -> dict[str, Any]:
    """Where ``dcp.save`` writes: a local directory, or a prefix of an object store through fsspec."""
    return {"storage_writer": FsspecWriter(str(staging))} if is_object_store(staging) else {"checkpoint_id": staging}


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (disk full, permissions): raised on every rank, the message names the rank
    and the cause; nothing was put in the checkpoint's place."""


def _save_failed(final: Location, error: BaseException) -> str:
    cause = str(error) if isinstance(error, RankZeroFailed) else validation.one_line(error)
    return (f"saving checkpoint {str(final)!r} failed: {cause}. Nothing was put in its place: the checkpoints saved "
            f"before it are intact (its partial files are in {str(final.parent / STAGING_DIR)!r}, removed by the "
            "next save)")


class RankZeroFailed(RuntimeError):
    """What rank 0 raised in :func:`on_rank_zero`, raised on every rank (its message starts with "rank 0: ")."""


def on_rank_zero(action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0; every rank raises if it failed (in place of a barrier, so no rank waits for a
    rank 0 that gave up). Collective."""
    failure = None
    if _rank() == 0:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - every rank raises it below
            failure = f"rank 0: {validation.one_line(error)}"
    if dist.is_available() and dist.is_initialized():
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure:
        raise RankZeroFailed(failure)


def _thenmove_into_place(written: Future, staging: Location, final: Location, *, move: bool) -> Future:
    # DCP's future completes on rank 0 after every rank has written and rank 0 has added the metadata.
    in_place: Future = Future()

    def finish(done: Future) -> None:
        try:
            done.result()
            if move:
                move_into_place(staging, final)
            in_place.set_result(final)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            failed = CheckpointSaveError(_save_failed(final, error))
            failed.__cause__ = error
            in_place.set_exception(failed)

    written.add_done_callback(finish)
    return in_place


def load_checkpoint(
    path: str | os.PathLike | Location,
    module: nn.Module,
    optimizers: list[Optimizer],
    *,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load weights into ``module`` and states into ``optimizers`` in place; return the other entries.

    Works with both formats, whatever layout ``module`` has now: DCP reshards tensors saved under
    another layout, and a full checkpoint is re-sharded by ``set_model_state_dict``. The non-tensor entries
    are unpickled with ``weights_only=True``, and a sharded checkpoint's DCP index with an unpickler that constructs
    only DCP's own classes (:mod:`lightning_par.checkpoint.safe_dcp`), unless ``weights_only=False`` says the file is trusted
    (:func:`read_metadata`). ``path`` is on disk or on an object store, as :func:`save_checkpoint` writes it.
    """
    path = location(path)
    aliases = tied_aliases(module)
    # This rank's part of the model: the shapes to check, the names it loads, DCP's template.
    local = model_state_dict(module, full=False, aliases=False)
    trainable = trainable_names(module)
    # Every rank checks what it can before any tensor is read, and all raise the first problem found.
    expected = validation.expected_shapes(local)
    problem, checkpoint, metadata = _check_before_loading(path, expected, len(optimizers), strict, weights_only,
                                                          trainable=trainable)
    validation.agree(problem)
    checkpoint.pop(validation.FORMAT_KEY, None)
    if FROZEN_BASE_KEY in checkpoint:  # the trainable parameters only: the rest is left as it is, to be read elsewhere
        local = {name: value for name, value in local.items() if name in trainable}
        expected, strict = {name: shape for name, shape in expected.items() if name in trainable}, False
    try:
        if metadata is not None:
            _load_sharded(path, module, local, optimizers, aliases, strict, weights_only)
        else:
            # A rank of a pipeline holds some of the model: the weights of the other ranks' stages are theirs to
            # load (names no rank holds stay, for a strict load to refuse).
            weights = with_aliases(checkpoint.pop(MODEL_KEY), aliases)
            weights = {name: tensor for name, tensor in weights.items()
                       if name in local or name in aliases or name not in expected}
            full = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(module, weights, options=full)
            for optimizer, state in zip(optimizers, checkpoint.pop(OPTIMIZERS_KEY, [])):
                _load_optimizer_state(module, optimizer, state, full=True)
    except (Exception, CheckpointException) as error:
        _refuse_pickled_code(error, path)
        raise validation.CheckpointError(f"loading checkpoint {str(path)!r} failed: {validation.one_line(error)}") from error
    checkpoint.pop(OPTIMIZERS_KEY, None)
    return checkpoint


def _refuse_pickled_code(error: BaseException, path: Location) -> None:
    """Raise the refusal of a non-tensor entry that ``weights_only=True`` would not unpickle, if ``error`` is one
    (DCP raises it on every rank)."""
    found = safe_dcp.refused_class(error)
    if found:
        raise validation.CheckpointError(validation.pickled_code_problem(path, found)) from None


def checkpoint_problem(path: str | os.PathLike | Location, *, weights_only: bool | None = None) -> str | None:
    """Why the checkpoint at ``path`` cannot be read (missing, not a checkpoint, truncated, written by a newer
    version, holding pickled code), or None: the checks :func:`load_checkpoint` runs before it reads a tensor, less
    those against a model. One process, no collective."""
    return _check_before_loading(location(path), {}, 0, False, weights_only)[0]


def _check_before_loading(path: Location, expected: dict[str, tuple[int, ...]], optimizers: int, strict: bool,
                          weights_only: bool | None,
                          trainable: set[str] | None = None) -> tuple[str | None, dict[str, Any], Any]:
    """(the problem found or None, the checkpoint's non-tensor entries, DCP's index for a sharded one). A checkpoint
    of the trainable parameters alone (:data:`FROZEN_BASE_KEY`) is checked against those of ``expected`` in
    ``trainable``."""
    if not path.exists():
        return f"checkpoint {str(path)!r} does not exist", {}, None
    try:
        if path.is_dir():
            problem, metadata = validation.sharded_problem(path, meta_file=META_FILE, weights_only=weights_only)
            if problem:
                return problem, {}, None
            checkpoint = read_metadata(path / META_FILE, weights_only)
            saved, saved_optimizers = validation.saved_shapes(metadata), validation.saved_optimizers(metadata)
        else:
            problem, metadata = validation.file_problem(path), None
            if problem:
                return problem, {}, None
            checkpoint = read_metadata(path, weights_only)
            if not isinstance(checkpoint, dict) or MODEL_KEY not in checkpoint:
                keys = list(checkpoint)[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
                return (f"{str(path)!r} is not a Lightning checkpoint: it has no {MODEL_KEY!r} entry (it holds "
                        f"{keys}); a plain state dict loads with model.load_state_dict(torch.load(...)) before "
                        "fit"), {}, None
            saved = {name: tuple(t.shape) if isinstance(t, Tensor) else None for name, t in checkpoint[MODEL_KEY].items()}
            saved_optimizers = len(checkpoint.get(OPTIMIZERS_KEY, []))
    except validation.CheckpointError as error:
        return str(error), {}, None
    if FROZEN_BASE_KEY in checkpoint and trainable is not None:
        expected = {name: shape for name, shape in expected.items() if name in trainable}
    problem = (validation.format_problem(path, checkpoint) or validation.model_problem(path, saved, expected, strict=strict)
               or validation.optimizer_problem(path, saved_optimizers, optimizers))
    return problem, checkpoint, metadata


def _load_sharded(path: Location, module: nn.Module, local: dict[str, Any], optimizers: list[Optimizer],
                  aliases: dict[str, str], strict: bool, weights_only: bool | None) -> None:
    def load(state: dict[str, Any]) -> None:
        dcp.load(state, storage_reader=safe_dcp.storage_reader(path, weights_only),
                 planner=safe_dcp.load_planner(weights_only))

    model_state = {MODEL_KEY: local}  # this rank's tensors, filled by DCP
    load(model_state)
    set_model_state_dict(module, with_aliases(model_state[MODEL_KEY], aliases),
                         options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        template = optimizer_state_dict(module, optimizer, full=False)
        own_params = [group["params"] for group in template["param_groups"]]
        load(optim_state := {key: template})
        # DCP keeps one rank's copy of non-tensor entries such as param_groups, and the ranks of a
        # pipeline hold different parameters: take the saved hyper-parameters, keep this rank's names.
        loaded = optim_state[key]
        loaded["param_groups"] = [{**_hyper_parameters(saved), "params": params}
                                  for saved, params in zip(loaded["param_groups"], own_params)]
        _load_optimizer_state(module, optimizer, loaded, full=False)


def consolidated_weights(checkpoint: str | os.PathLike | Location, *,
                         weights_only: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(whole weights by name, the checkpoint's other entries) of a checkpoint of either format, in one process.
    A tied parameter appears under each of its names as one tensor."""
    checkpoint = location(checkpoint)
    problem, saved, metadata = _check_before_loading(checkpoint, {}, 0, False, weights_only)
    if problem:  # raised here only: this runs in one process, maybe one rank of a larger run
        raise validation.CheckpointError(problem)
    if metadata is not None:
        try:
            weights = _read_sharded_weights(checkpoint, metadata, weights_only)
        except (Exception, CheckpointException) as error:
            _refuse_pickled_code(error, checkpoint)
            raise
    else:
        weights = saved.pop(MODEL_KEY)
    saved.pop(OPTIMIZERS_KEY, None)
    return with_aliases({name: tensor.contiguous() for name, tensor in weights.items()}, saved.get(TIED_KEY, {})), saved


def _read_sharded_weights(path: Location, metadata: Any, weights_only: bool | None) -> dict[str, Any]:
    """The whole model weights of a sharded checkpoint, read in this one process (not the optimizer states)."""
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        where = metadata.planner_data.get(key, (key,))
        if where[0] == MODEL_KEY:  # a template DCP fills: an empty tensor of the saved shape, or a non-tensor entry
            value = torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(
                entry, TensorStorageMetadata) else None
            set_element(state, where, value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=safe_dcp.storage_reader(path, weights_only),
                 planner=safe_dcp.load_planner(weights_only), no_dist=True)
    return state.get(MODEL_KEY, {})


def export_consolidated(checkpoint: str | os.PathLike | Location, output: str | os.PathLike | Location, *,
                        weights_only: bool | None = None) -> dict[str, torch.Tensor]:
    """Write the model weights of a checkpoint (either format) as one plain ``{name: tensor}`` file.

    Runs in a single process, no process group needed, whatever layout wrote the checkpoint. The result
    loads anywhere with ``model.load_state_dict(torch.load(output, weights_only=True))`` - no
    lightning_par, no Lightning, no pickled code. The checkpoint's metadata is read as :func:`read_metadata`
    reads it (``weights_only=False`` for a trusted file holding other Python objects).
    """
    output = location(output)
    weights, _ = consolidated_weights(checkpoint, weights_only=weights_only)
    staging = staging_path(output)
    staging.parent.mkdir(parents=True, exist_ok=True)
    with staging.open("wb") as stream:
        torch.save(weights, stream)
    move_into_place(staging, output)
    return weights


def remove_checkpoint(path: str | os.PathLike | Location) -> None:
    """Delete a checkpoint of either format (call on one rank)."""
    remove(location(path))


def read_metadata(path: str | os.PathLike | Location, weights_only: bool | None = None) -> dict[str, Any]:
    """A checkpoint file (a full checkpoint, or a sharded one's ``meta.pt``) unpickled.

    By default with ``weights_only=True`` (PyTorch's default since 2.6, and Lightning's): tensors, containers,
    builtins and the NumPy RNG state load; any other Python object, which could run code as it is unpickled,
    is refused with a message that names it. ``weights_only=False`` (a strategy's ``checkpoint_weights_only=False``,
    ``lightning-par-export --trust-pickled-code``) loads a file whose source you trust.
    """
    path = location(path)
    try:
        if weights_only is False:
            return torch.load(readable(path), map_location="cpu", weights_only=False)
        return safe_dcp.load_object(readable(path))
    except safe_dcp.PickledCodeError as error:
        raise validation.CheckpointError(validation.pickled_code_problem(path, error.found)) from None
    except pickle.UnpicklingError as error:
        raise validation.CheckpointError(f"checkpoint {str(path)!r} is corrupt: {validation.one_line(error)}; load an "
                                    "earlier checkpoint") from None
    except (RuntimeError, EOFError, OSError) as error:  # torch's zip reader: a member cut short or damaged
        raise validation.CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupt: {validation.one_line(error)}; "
                                    "load an earlier checkpoint") from None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0



__all__ = [
    "RankZeroFailed",
    "on_rank_zero",
    "model_state_dict",
    "optimizer_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "is_sharded_checkpoint",
    "checkpoint_problem",
    "remove_checkpoint",
    "export_consolidated",
    "read_metadata",
]

