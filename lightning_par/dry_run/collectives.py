"""Every collective a dry-run step issues, by mesh dimension: calls and bytes, read where the op is dispatched.

On the fake backend nothing reaches a flight recorder, so :class:`CollectiveRecorder` (a ``TorchDispatchMode``)
sees each ``c10d`` and functional collective on its way to the process group: FSDP2's all-gathers and
reduce-scatters, DTensor's collectives, the gradient all-reduces, expert all-to-alls and the pipeline's sends. Sizes
are counted as :mod:`lightning_par.parallel.comm` counts them in a run (the larger of a collective's input and
output; a send its tensor), so the dry run's figures and TensorBoard's ``comm/*_bytes`` mean the same. DDP's bucketed
all-reduces run inside its C++ reducer, below the dispatcher: a layout trained by DDP (pure data parallel without
ZeRO-3, tensor or pipeline parallel) reports them from the gradients instead (``ddp_bytes``).

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.fake_collectives import collective_ops, sync_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.comm import DIMENSIONS, CommTotals, dimension_of_group, world_dimension

__all__ = ["CollectiveRecorder"]

_RECEIVES = {torch.ops.c10d.recv_.default, torch.ops.c10d.recv_any_source_.default}
_RECORDED = collective_ops - sync_ops - _RECEIVES


class CollectiveRecorder(TorchDispatchMode):
    """Totals per dimension (:data:`~lightning_par.parallel.comm.DIMENSIONS`) of the collectives dispatched while
    the mode is on; ``totals`` accumulates until :meth:`reset`."""

    def __init__(self, mesh: ParallelMesh) -> None:
        super().__init__()
        self._world = world_dimension(mesh)
        self.totals: dict[str, CommTotals] = {}
        self.reset()

    def reset(self) -> None:
        self.totals = {dimension: CommTotals() for dimension in DIMENSIONS}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        # A collective on real tensors is the dry run's own (the pipeline stages' vote, taken on real tensors).
        if func in _RECORDED and any(isinstance(leaf, FakeTensor) for leaf in tree_leaves(args)):
            group = _process_group(args)
            if group is not None and group.size() > 1:
                total = self.totals[dimension_of_group(group.group_desc, self._world)]
                total.calls += 1
                total.bytes += max(_bytes(value) for value in (*args, result))
        return result


def _process_group(args: tuple) -> Any:
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    for value in args:
        if isinstance(value, ProcessGroup):
            return value
        if isinstance(value, torch.ScriptObject):  # c10d ops carry the group boxed (beside a boxed ReduceOp)
            try:
                return ProcessGroup.unbox(value)
            except RuntimeError:
                continue
        if isinstance(value, str):
            try:
                return _resolve_process_group(value)
            except (RuntimeError, ValueError):
                continue
    return None


def _bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a list of them)."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))
