"""Parameters that several pipeline stages hold, kept equal.

Megatron-LM's answer to weight tying across stages (Shoeybi et al. 2019; the "embedding group" of Narayanan et al.
2021): each stage that uses the tensor holds a copy, the copies start equal, and after backward their gradients are
summed over the ranks that hold them, so every copy takes the same optimizer step. :class:`StageTies` does this for
any parameter held on several pipeline ranks, and says which copy the gradient norm counts (once). Inside one stage
a tied parameter stays one tensor (:func:`lightning_par.parallel.modules.retie`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par.parallel.mesh import ParallelMesh


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


__all__ = ["StageTies"]
