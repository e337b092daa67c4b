"""Module helpers every technique uses: names as state dicts spell them, tied parameters, the first tensor of an
output, parameters built on the meta device. The ground floor of ``lightning_par.parallel``: it imports no
technique, so no technique has to import another for these.

Tied parameters: one tensor that several modules use, kept one tensor under every layout. Weight tying (Press &
Wolf 2017, "Using the Output Embedding to Improve Language Models"; Inan et al. 2017) shares the input embedding
with the output head: GPT-2, Gemma, the small Qwen2.5 and Llama-3.2 sizes, nanoGPT. Any other sharing (a parameter
registered under two names) is treated the same way. Tensor parallel replaces each module's parameters with
DTensors one module at a time, which would give each user its own copy: :func:`retie` points every name of a group
back at one DTensor (the users must be split alike, e.g. a vocabulary-parallel embedding and a column-parallel head:
both ``Shard(0)``). Across pipeline stages the copies are kept equal by
:class:`~lightning_par.parallel.pipeline.ties.StageTies`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

# Wrappers that must not appear in the names a checkpoint or a model map uses.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name as state dicts spell it (without activation-checkpoint or compile wrappers)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def tied_groups(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of every parameter registered under more than one name, one tuple per parameter, each in
    registration order (the first name is the one state dicts and optimizers key it by)."""
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(clean_name(name))
    return [tuple(group) for group in names.values() if len(group) > 1]


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for every tied parameter: what a checkpoint can leave out and restore."""
    return {alias: group[0] for group in tied_groups(module) for alias in group[1:]}


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (module.get_submodule(parent) if parent else module), leaf


def retie(module: nn.Module, groups: Iterable[tuple[str, ...]]) -> None:
    """Make every name of each group refer to one parameter again, after a transform replaced them one by one.

    The split (DTensor) version wins; it must be the same split for every user, because the same tensor is
    used by both. A module marked ``holds_only`` keeps a tied parameter without computing with it (a pipeline
    stage's stand-in for a part it does not run), so it takes whatever version the others use; so does a module
    that holds the parameter of one of its own submodules (Hugging Face's ``BertLMPredictionHead.bias``, which is
    its ``decoder.bias``). Raises ``ValueError`` naming the users when they are split differently.
    """
    for group in groups:
        users = {name: _owner(module, name) for name in group}
        versions = {name: getattr(owner, leaf) for name, (owner, leaf) in users.items()}
        computing = {name: tensor for name, tensor in versions.items()
                     if not getattr(users[name][0], "holds_only", False) and not holds_for_submodule(name, group)}
        split = {name: tensor for name, tensor in computing.items() if isinstance(tensor, DTensor)}
        if split and len(split) != len(computing):
            plain = sorted(set(computing) - set(split))
            raise ValueError(f"{group[0]!r} is tied to {', '.join(repr(n) for n in group[1:])}, but tensor parallel "
                             f"splits {sorted(split)} and leaves {plain} whole: one tensor cannot be both; give "
                             "every user the same split in the model map (an embedding 'vocab' with a head 'colwise') "
                             "or leave them all 'replicate'")
        layouts = {(tuple(t.placements), t.device_mesh, tuple(t.shape)) for t in split.values()}
        if len(layouts) > 1:
            described = {name: tuple(str(p) for p in t.placements) for name, t in split.items()}
            raise ValueError(f"tied parameter {group[0]!r} is split differently by its users {described}; one tensor "
                             "has one layout: mark the users so that they split it alike")
        chosen = next(iter(split.values()), None) if split else next(iter(computing.values()), versions[group[0]])
        for name, (owner, leaf) in users.items():
            if versions[name] is not chosen:
                owner._parameters[leaf] = chosen


def holds_for_submodule(name: str, group: tuple[str, ...]) -> bool:
    """Whether parameter ``name``'s module is an ancestor of the module of another name in ``group`` (it holds the
    parameter of one of its submodules, which computes with it)."""
    owner = name.rpartition(".")[0]
    return any(other != name and (not owner or other.startswith(owner + ".")) and other.count(".") > name.count(".")
               for other in group)


def first_tensor(output: Any) -> tuple[Tensor | None, int | None, int]:
    """(tensor, index, length) of the first tensor of a module output: a tensor, a tuple/list, or a
    ``ModelOutput`` (index None: the output is the tensor)."""
    if isinstance(output, Tensor):
        return output, None, 1
    items = output.to_tuple() if hasattr(output, "to_tuple") else output
    if isinstance(items, (tuple, list)):
        for index, item in enumerate(items):
            if isinstance(item, Tensor):
                return item, index, len(items)
    return None, None, 0


def materialize_meta_parameters(module: nn.Module, device: torch.device) -> bool:
    """Allocate parameters created on the meta device and initialise them; return whether there were any.

    Called after sharding under ZeRO-3, so each rank allocates only its shards and a model larger than
    one device is never whole anywhere. Initialisation uses the model's own ``init_weights()`` where a
    module defines one (the reference model does: scaled init, rotary tables) and Lightning's convention,
    ``reset_parameters()``, for modules outside those.
    """
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return False
    ties = tied_groups(module)
    module.to_empty(device=device)
    retie(module, ties)  # to_empty allocates each module's parameters on their own: a tied head would come apart
    covered: set[nn.Module] = set()
    with torch.no_grad():
        for sub in module.modules():
            if sub in covered:
                continue
            if callable(getattr(sub, "init_weights", None)):
                try:
                    sub.init_weights()
                except AttributeError as error:
                    raise ValueError(
                        f"{type(sub).__name__}.init_weights() failed on the model as this rank holds it ({error}): "
                        "under pipeline parallel a stage holds stand-ins for the parts other stages run; make "
                        "init_weights() skip parts without the weights it initialises"
                    ) from error
                covered.update(sub.modules())
            elif callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
    return True


def is_expert(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an expert weight split by expert parallel (a DTensor on the ``ep`` mesh)."""
    return isinstance(tensor, DTensor) and "ep" in (tensor.device_mesh.mesh_dim_names or ())


__all__ = ["clean_name", "first_tensor", "holds_for_submodule", "is_expert", "materialize_meta_parameters", "retie",
           "tied_aliases", "tied_groups"]
