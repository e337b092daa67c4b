"""Gradient clipping by the norm of the whole gradient, wherever its pieces live.

Clipping scales every gradient by ``max_norm / ||g||`` where ``||g||`` is the 2-norm of the gradient of
the whole model (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks"). Under
model parallelism no rank holds that gradient: tensor parallel and ZeRO-3 leave DTensor shards (on
different meshes: a 2-D data x tensor mesh for split layers, the data mesh alone for replicated norms),
and ZeRO-2 leaves each rank the whole gradients of the parameters it owns only. The norm is assembled
from those pieces so that every rank scales by the factor one process holding everything would use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par.parallel.modules import is_expert
from lightning_par.parallel.experts import local_part


@torch.no_grad()
def gradient_norm(parameters: list[Tensor], *, partition_group: dist.ProcessGroup | None = None,
                  stage_group: dist.ProcessGroup | None = None) -> float:
    """The 2-norm of the whole model's gradient, the same on every rank. Collective.

    DTensor gradients contribute their whole norm (reduced over their own mesh). ``partition_group``:
    the ranks over which the gradients are partitioned (ZeRO-2; ZeRO-1 reducing to owners, with tensor-parallel
    DTensors among them, and expert-parallel ones partitioned over their replicas); every square is summed there.
    ``stage_group``: the ranks holding other pipeline stages; every square is summed there.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    # Under a partition the experts' gradients are partitioned too, over the ranks holding the same experts, which
    # with the ranks splitting them make up the partition group: their local squares add up there like plain ones.
    def counted_here(grad: Tensor) -> bool:
        return not isinstance(grad, DTensor) or (partition_group is not None and is_expert(grad))

    plain = torch.zeros((), dtype=torch.float64)
    sharded = _sharded_squares([g for g in grads if not counted_here(g)])
    for grad in filter(counted_here, grads):
        plain += local_part(grad).detach().double().pow(2).sum().cpu()
    for group in (partition_group, stage_group):
        if group is not None:
            # A step skipped as bad has no gradients, on every rank alike: the parameters say where the group computes.
            squares = torch.stack([plain, sharded]).to(_device(grads or parameters))
            dist.all_reduce(squares, group=group)
            plain, sharded = squares.cpu()
    return float((plain + sharded).sqrt())


@torch.no_grad()
def clip_grad_norm_(parameters: list[Tensor], max_norm: float, *,
                    partition_group: dist.ProcessGroup | None = None,
                    stage_group: dist.ProcessGroup | None = None,
                    counted: list[Tensor] | None = None) -> float:
    """Clip ``parameters``' gradients in place to a total 2-norm of ``max_norm``; return the norm before
    (see :func:`gradient_norm` for the groups). ``counted``: the parameters the norm is taken over, when a
    tensor held on several pipeline ranks must count once (default: ``parameters``)."""
    total = gradient_norm(parameters if counted is None else counted, partition_group=partition_group,
                          stage_group=stage_group)
    coefficient = min(1.0, max_norm / (total + 1e-6))
    if coefficient < 1.0:
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(coefficient)
    return total


def _sharded_squares(grads: list[Tensor]) -> Tensor:
    """The summed squares of every DTensor gradient, with one all-reduce per mesh dimension, not per tensor.

    Each rank adds the squares of its local shard, divided by the number of ranks holding the same values
    (the sizes of the dimensions the tensor is replicated on); summing that over every dimension of the
    tensor's mesh counts each element once. A pending (Partial) gradient cannot be squared locally: its
    norm is reduced on its own.
    """
    total = torch.zeros((), dtype=torch.float64)
    by_mesh: dict[int, tuple[object, Tensor]] = {}
    for grad in grads:
        if not isinstance(grad, DTensor):
            continue
        if any(placement.is_partial() for placement in grad.placements):
            total += torch.linalg.vector_norm(grad, dtype=torch.float32).full_tensor().double().cpu() ** 2
            continue
        replicas = 1
        for size, placement in zip(grad.device_mesh.shape, grad.placements):
            replicas *= size if placement.is_replicate() else 1
        mesh, squares = by_mesh.get(id(grad.device_mesh), (grad.device_mesh, torch.zeros((), dtype=torch.float64)))
        by_mesh[id(grad.device_mesh)] = (mesh, squares + grad.to_local().detach().double().pow(2).sum().cpu() / replicas)
    for mesh, squares in by_mesh.values():
        squares = squares.to(mesh.device_type)
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                dist.all_reduce(squares, group=mesh.get_group(dim))
        total += squares.cpu()
    return total


def _device(tensors: list[Tensor]) -> torch.device:
    """Where the process group's tensors must live (nccl: on the accelerator): where ``tensors`` are."""
    if not tensors:
        return torch.device("cpu")
    return tensors[0].to_local().device if isinstance(tensors[0], DTensor) else tensors[0].device


__all__ = ["clip_grad_norm_", "gradient_norm"]
