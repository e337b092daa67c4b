"""Fused projections regrouped for tensor parallel: each rank holds its share of every section.

A fused projection computes several projections with one matrix, and the model cuts its output into sections by
size: ``[q | k | v]`` (litgpt's ``qkv``, GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) or ``[gate | up]``. Split
column-wise as stored, rank 0 would hold all of q and rank 1 the keys and values. Megatron-LM keeps such a matrix
grouped by attention head (or query group: Ainslie et al. 2023, "GQA"), so that a contiguous split gives each rank
the q, k and v of its own heads (Shoeybi et al. 2019, "Megatron-LM", section 3). Here the rows are put in that order
once, when the layer is split: rank ``r``'s rows are part ``r`` of every section, ``[q_r | k_r | v_r]``. The model's
own code then cuts its local output with per-rank sizes (:mod:`lightning_par.parallel.local_heads`).

Whatever reads or writes the model's state sees the stored order: the layer's ``state_dict()`` and
``load_state_dict()`` convert its regrouped rows (DTensor shards are gathered, reordered and sliced again, a
collective over the tensor's mesh), so ``model.state_dict()``, a checkpoint or an exported model is what a single
process would write, and loads under any layout. :func:`to_stored_order` and :func:`to_training_order` convert the
optimizer's states (keyed by parameter name) the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par.parallel.modules import clean_name


@dataclass(frozen=True)
class Regrouped:
    """The rows of a layer's parameters along ``dims`` (parameter name -> dimension of the output features) are in
    training order: part ``r`` of every section for each of ``parts`` ranks in turn."""

    sections: tuple[int, ...]
    parts: int
    dims: dict[str, int]

    def order(self) -> Tensor:
        """Training row ``i`` is stored row ``order()[i]``."""
        return section_order(self.sections, self.parts)


def section_order(sections: tuple[int, ...], parts: int) -> Tensor:
    """The stored rows in training order: for each of ``parts`` ranks, its part of each section in turn."""
    bad = [size for size in sections if size % parts]
    if bad:
        raise ValueError(f"tp={parts!r} does not divide the sections {list(sections)} of a fused "
                         f"projection (sizes {bad}); tensor-parallel sizes that fit: "
                         f"{[d for d in range(1, 65) if all(size % d == 0 for size in sections)]}")
    starts = torch.tensor([0, *sections]).cumsum(0)[:-1].tolist()
    return torch.cat([torch.arange(start + rank * size // parts, start + (rank + 1) * size // parts)
                      for rank in range(parts) for start, size in zip(starts, sections)])


def regroup_rows(layer: nn.Module, sections: tuple[int, ...], parts: int, dims: dict[str, int]) -> None:
    """Put the rows of ``layer``'s parameters ``dims`` in training order, in place (on the meta device too)."""
    width = sum(sections)
    order = section_order(tuple(sections), parts)
    regrouped = Regrouped(tuple(sections), parts, dict(dims))
    for name, dim in dims.items():
        parameter = layer.get_parameter(name)
        if parameter.shape[dim] != width:
            raise ValueError(f"the sections {list(sections)} of {type(layer).__name__} add up to {width}, but its "
                             f"{name} has {parameter.shape[dim]} output features: give sections that cover them")
        parameter.data = parameter.data.index_select(dim, order.to(parameter.device))
    layer.regrouped_rows = regrouped
    # The layer's own state dict keeps the model's order, whoever reads it (model.state_dict(), DCP, a checkpoint).
    layer.register_state_dict_post_hook(_state_dict_in_stored_order)
    layer.register_load_state_dict_pre_hook(_state_dict_in_training_order)


def _state_dict_in_stored_order(layer: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    """``layer.state_dict()`` with its regrouped rows in the order the model stores them. Collective over the
    tensor-parallel ranks, as reading any split tensor whole is; ``keep_vars=True`` keeps the parameters themselves
    (in training order)."""
    regrouped: Regrouped = layer.regrouped_rows
    stored = torch.argsort(regrouped.order())
    for name, dim in regrouped.dims.items():
        value = state.get(prefix + name)
        if isinstance(value, Tensor) and value is not layer.get_parameter(name):
            state[prefix + name] = _reorder(value, dim, stored)


def _state_dict_in_training_order(layer: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """What ``layer.load_state_dict()`` reads, in the model's order, put in training order first."""
    regrouped: Regrouped = layer.regrouped_rows
    order = regrouped.order()
    for name, dim in regrouped.dims.items():
        value = state.get(prefix + name)
        if isinstance(value, Tensor) and value.dim() > dim and value.shape[dim] == len(order):
            state[prefix + name] = _reorder(value, dim, order)


def regrouped_parameters(module: nn.Module) -> dict[str, tuple[int, Tensor]]:
    """State-dict name -> (dimension, training order) of every regrouped parameter of ``module``, in name order."""
    found: dict[str, tuple[int, Tensor]] = {}
    for name, sub in module.named_modules():
        regrouped = getattr(sub, "regrouped_rows", None)
        if isinstance(regrouped, Regrouped):
            order = regrouped.order()
            for parameter, dim in regrouped.dims.items():
                found[clean_name(f"{name}.{parameter}" if name else parameter)] = (dim, order)
    return dict(sorted(found.items()))


def to_stored_order(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model state dict of ``module``) with regrouped parameters in the order the model stores them.
    Collective over the tensor-parallel ranks where a value is a DTensor."""
    return _reordered(module, state, inverse=True)


def to_training_order(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in stored order, as ``module`` trains it (the inverse of :func:`to_stored_order`)."""
    return _reordered(module, state, inverse=False)


def optimizer_to_stored_order(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, its per-parameter tensors (momentum, moments) of regrouped
    parameters in stored order."""
    return _optimizer_reordered(module, state, to_stored_order)


def optimizer_to_training_order(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    return _optimizer_reordered(module, state, to_training_order)


def _optimizer_reordered(module: nn.Module, state: dict[str, Any],
                         convert: Callable[[nn.Module, dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    if not regrouped_parameters(module) or "state" not in state:
        return state
    per_parameter = dict(state["state"])
    keys = sorted({key for value in per_parameter.values() if isinstance(value, dict) for key in value})
    for key in keys:  # one state dict per kind of state, in the same order on every rank
        values = {name: value[key] for name, value in per_parameter.items()
                  if isinstance(value, dict) and key in value}
        converted = convert(module, values)
        for name, value in converted.items():
            if value is not values[name]:
                per_parameter[name] = {**per_parameter[name], key: value}
    return {**state, "state": per_parameter}


def _reordered(module: nn.Module, state: dict[str, Any], *, inverse: bool) -> dict[str, Any]:
    regrouped = regrouped_parameters(module)
    if not regrouped:
        return state
    state = dict(state)
    for name, (dim, order) in regrouped.items():
        value = state.get(name)
        if not isinstance(value, Tensor) or value.dim() <= dim or value.shape[dim] != len(order):
            continue  # not held here (another pipeline stage), or a scalar state such as a step count
        state[name] = _reorder(value, dim, torch.argsort(order) if inverse else order)
    return state


def _reorder(value: Tensor, dim: int, index: Tensor) -> Tensor:
    if not isinstance(value, DTensor):
        return value.index_select(dim, index.to(value.device))
    mesh = value.device_mesh
    local = value.to_local()
    # A state offloaded to the CPU is gathered on the mesh's device, then put back.
    on_mesh = DTensor.from_local(local.detach().to(mesh.device_type), mesh, value.placements, shape=value.shape,
                                 stride=value.stride(), run_check=False)
    whole = on_mesh.full_tensor().index_select(dim, index.to(mesh.device_type))
    result = distribute_tensor(whole, mesh, value.placements, src_data_rank=None)
    return DTensor.from_local(result.to_local().to(local.device), mesh, value.placements, shape=value.shape,
                              stride=value.stride(), run_check=False)


__all__ = ["Regrouped", "optimizer_to_stored_order", "optimizer_to_training_order", "regroup_rows",
           "regrouped_parameters", "section_order", "to_stored_order", "to_training_order"]
