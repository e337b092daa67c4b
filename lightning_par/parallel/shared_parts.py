"""Parts of a model's layers that several layers hold: one set of weights run at several depths.

Cross-layer parameter sharing (Dehghani et al. 2019, "Universal Transformers"; Lan et al. 2020, "ALBERT") and the
shared blocks of hybrid models (Glorioso et al. 2024, "Zamba": one attention block called from every sixth Mamba
layer; Zamba2 alternates two) hold one tensor in several layers, either as one module that several layers reference
or as modules of their own whose parameters are tied (transformers builds Zamba2 so). Techniques that give each
layer its own share of the parameters must treat such a part as one thing:

- ZeRO-3 (``lightning_par.parallel.zero``) shards a part held by several layers as one FSDP2 unit of its own,
  gathered each time a layer runs it (FSDP2 manages a parameter in one unit only);
- pipeline parallel holds it on every stage whose layers use it and keeps the copies equal, as tied parameters
  (``lightning_par.parallel.pipeline.ties``).

:func:`shared_parts` finds them by parameter identity, so neither the names nor the way of sharing matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class SharedPart:
    """Modules inside the layers that hold tensors of several layers between them.

    ``names``: the full name of the part at each layer position that holds it; ``modules``: the distinct modules
    (one where the layers reference the same module, one per layer where their parameters are tied)."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]


def shared_parts(layers: Sequence[tuple[str, nn.Module]]) -> list[SharedPart]:
    """The parts of ``layers`` ((full name, layer) pairs, each layer module once) that hold parameters another layer
    holds too, one :class:`SharedPart` per set of modules tied together; empty when the layers share nothing.

    A part is the outermost module inside a layer whose parameters are all shared (a shared transformer block, not
    the layer around it, which holds its own norms and projections); a shared parameter held by a module that also
    holds parameters of its own makes that module the part (the layer itself, where it holds the parameter
    directly)."""
    holders: dict[int, set[int]] = {}  # id(parameter) -> indices of the layers holding it
    for index, (_, layer) in enumerate(layers):
        for parameter in layer.parameters():
            holders.setdefault(id(parameter), set()).add(index)
    shared = {key for key, indices in holders.items() if len(indices) > 1}
    if not shared:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, layer in layers:
        covered: list[str] = []
        for relative, sub in layer.named_modules():
            if any(relative.startswith(c + ".") for c in covered):
                continue
            own = {id(p) for p in sub.parameters()}
            direct = {id(p) for p in sub.parameters(recurse=False)}
            if own and (own <= shared or direct & shared):
                found.append((f"{name}.{relative}" if relative else name, sub))
                covered.append(relative)
    return _group_by_parameters(found)


def _group_by_parameters(found: list[tuple[str, nn.Module]]) -> list[SharedPart]:
    """Parts that hold a parameter in common, grouped (union-find over the parts), in the order they were found."""
    parent = list(range(len(found)))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    owner: dict[int, int] = {}
    for index, (_, module) in enumerate(found):
        for parameter in module.parameters():
            first = owner.setdefault(id(parameter), index)
            parent[root(index)] = root(first)
    groups: dict[int, list[int]] = {}
    for index in range(len(found)):
        groups.setdefault(root(index), []).append(index)
    parts = []
    for indices in groups.values():
        modules: list[nn.Module] = []
        for index in indices:
            if not any(found[index][1] is m for m in modules):
                modules.append(found[index][1])
        parts.append(SharedPart(tuple(found[i][0] for i in indices), tuple(modules)))
    return parts


__all__ = ["SharedPart", "shared_parts"]
