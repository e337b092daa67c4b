"""Tied parameters: one tensor that several modules use, kept one tensor under every layout.

Weight tying (Press & Wolf 2017, "Using the Output Embedding to Improve Language Models"; Inan et al. 2017)
shares the input embedding with the output head: GPT-2, Gemma, the small Qwen2.5 and Llama-3.2 sizes,
nanoGPT. Any other sharing (a parameter registered under two names) is treated the same way.

- Tensor parallel replaces each module's parameters with DTensors one module at a time, which would give
  each user its own copy: :func:`retie` points every name of a group back at one DTensor (the users must be
  split alike, e.g. a vocabulary-parallel embedding and a column-parallel head: both ``Shard(0)``).
- Pipeline parallel puts the users on different stages. Megatron-LM's answer (Shoeybi et al. 2019; the
  "embedding group" of Narayanan et al. 2021): each stage that uses the tensor holds a copy, the copies start
  equal, and after backward their gradients are summed over the ranks that hold them, so every copy takes the
  same optimizer step. :class:`StageTies` does this for any parameter held on several pipeline ranks, and
  says which copy the gradient norm counts (once).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.mesh import ParallelMesh

# Wrappers that must not appear in the names a checkpoint or a plan uses.
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
    stage's stand-in for a part it does not run), so it takes whatever version the others use. Raises
    ``ValueError`` naming the users when they are split differently.
    """
    for group in groups:
        users = {name: _owner(module, name) for name in group}
        versions = {name: getattr(owner, leaf) for name, (owner, leaf) in users.items()}
        computing = {name: tensor for name, tensor in versions.items()
                     if not getattr(users[name][0], "holds_only", False)}
        split = {name: tensor for name, tensor in computing.items() if isinstance(tensor, DTensor)}
        if split and len(split) != len(computing):
            plain = sorted(set(computing) - set(split))
            raise ValueError(f"{group[0]!r} is tied to {', '.join(repr(n) for n in group[1:])}, but tensor parallel "
                             f"splits {sorted(split)} and leaves {plain} whole: one tensor cannot be both; give "
                             "every user the same split in the plan (an embedding 'vocab' with a head 'colwise') "
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


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StageTies:
    """Parameters that several pipeline ranks hold, kept equal: same start, summed gradients.

    ``holders`` maps each such parameter (on this rank) to the pipeline ranks that hold a copy. Groups of the
    same pipeline ranks share one process group per data/tensor-parallel coordinate (Megatron's embedding
    group); a rank holding a copy it did not use this step contributes zeros and still receives the sum, so
    that every copy steps alike.
    """

    def __init__(self, holders: dict[Tensor, tuple[int, ...]], mesh: ParallelMesh) -> None:
        self.pp_rank = mesh.local_rank("pp")
        self._groups: list[tuple[dist.ProcessGroup, int, list[Tensor]]] = []
        self._not_counted: set[int] = set()
        by_ranks: dict[tuple[int, ...], list[Tensor]] = {}
        for parameter, ranks in holders.items():
            by_ranks.setdefault(tuple(sorted(ranks)), []).append(parameter)
            if self.pp_rank != min(ranks):
                self._not_counted.add(id(parameter))
        # Every rank creates the same groups in the same order (new_group is collective over the world), so
        # the sets of ranks come from every rank's view: each rank passes its own, gathered here.
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(by_ranks))
        all_rank_sets = sorted({tuple(ranks) for per_rank in every for ranks in per_rank})
        # Global ranks along pp, one row per coordinate of the other dimensions.
        lines = mesh.root.mesh.reshape(mesh.size("pp"), -1).T.tolist()
        for ranks in all_rank_sets:
            subgroups = [[line[r] for r in ranks] for line in lines]
            mine, _ = dist.new_subgroups_by_enumeration(subgroups, backend=dist.get_backend())
            if ranks in by_ranks and mine is not None:
                source = dist.get_global_rank(mine, 0)
                self._groups.append((mine, source, by_ranks[ranks]))

    @torch.no_grad()
    def make_equal(self) -> None:
        """Copy each tied tensor from the lowest pipeline rank holding it to the others (at set-up)."""
        for group, source, parameters in self._groups:
            for parameter in parameters:
                dist.broadcast(_local(parameter), src=source, group=group)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Sum each tied tensor's gradient over the ranks that hold it; every copy gets the sum."""
        for group, _, parameters in self._groups:
            grads = []
            for parameter in parameters:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                grad = parameter.grad
                if isinstance(grad, DTensor) and grad.placements != parameter.placements:
                    # DTensor's backward can leave a gradient in another layout than its parameter (a vocabulary-
                    # parallel embedding's comes back Replicate, while the head's copy is Shard(0)): the copies
                    # add up shard by shard only in their parameter's layout.
                    parameter.grad = grad = grad.redistribute(parameter.device_mesh, parameter.placements)
                grads.append(_local(grad))
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)

    def counted(self, parameters: Iterable[Tensor]) -> list[Tensor]:
        """``parameters`` without the copies another rank counts: each tied tensor enters a norm once."""
        return [p for p in parameters if id(p) not in self._not_counted]

    def __bool__(self) -> bool:
        return bool(self._groups)


__all__ = ["StageTies", "clean_name", "retie", "tied_aliases", "tied_groups"]
