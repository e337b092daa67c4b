"""ZeRO-1 and -2 for models with experts split by expert parallel: the experts' optimizer states partitioned over
the ranks that hold the same experts, the other states over ``dp_shard x cp``.

ZeRO partitions a parameter's states over the data-parallel ranks that hold the same parameter and see different
tokens (Rajbhandari et al. 2020). For a dense weight those are ``dp_shard x cp``; an expert split over ``ep`` of
those ranks is held only by the ``dp_shard x cp / ep`` ranks of its replica that hold the same experts
(:meth:`~lightning_par.parallel.mesh.ParallelMesh.experts`'s ``partition``; Megatron-Core's distributed optimizer keeps a
separate "expert data-parallel" group the same way). So one ``ZeroRedundancyOptimizer`` per kind of parameter,
each over its own group, stepped together as one optimizer whose parameter groups are the user's.

Expert gradients are summed over their replicas by expert parallel's own hook (the all-to-alls already summed them
over the tokens of the ``ep`` group); under a partition, a rank then keeps only those of the experts it steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer


class ZeroWithExperts(Optimizer):
    """One optimizer over two ``ZeroRedundancyOptimizer`` parts: ``dense`` (partitioned over ``dp_shard x cp``) and
    ``experts`` (over the ranks holding the same experts).

    ``param_groups`` are the user's groups, every parameter in them, so LR schedulers and checkpoints see what they
    would see without experts; each part's groups are the same groups cut to its parameters, and take the user
    groups' hyper-parameters before every step.
    """

    def __init__(self, groups: list[dict[str, Any]], make_part: Callable[[list[dict[str, Any]], bool], Any],
                 is_expert: Callable[[Tensor], bool]) -> None:
        self.param_groups = groups
        self.defaults: dict[str, Any] = {}
        self.state: dict[Tensor, Any] = {}  # the parts hold the states (checkpoint.optimizer_state_dict reads them)
        self.parts: list[ZeroRedundancyOptimizer] = []
        self.group_of_part_group: list[list[int]] = []  # per part: the user group each of its groups comes from
        for expert in (False, True):
            cut = [(index, {**group, "params": [p for p in group["params"] if is_expert(p) == expert]})
                   for index, group in enumerate(groups)]
            cut = [(index, group) for index, group in cut if group["params"]]
            self.parts.append(make_part([group for _, group in cut], expert))
            self.group_of_part_group.append([index for index, _ in cut])
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @property
    def dense(self) -> ZeroRedundancyOptimizer:
        return self.parts[0]

    @property
    def experts(self) -> ZeroRedundancyOptimizer:
        return self.parts[1]

    def owns(self, param: Tensor) -> bool:
        """Whether this rank steps ``param`` (and so keeps its gradient under a partition)."""
        part = self.experts if param in self.experts._param_to_rank else self.dense
        return part._param_to_rank[param] == part.rank

    def part_groups(self, part: int, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``groups`` (the user's, in order) as part ``part`` holds them."""
        return [groups[index] for index in self.group_of_part_group[part]]

    def _copy_hyper_parameters(self) -> None:
        for part_index, part in enumerate(self.parts):
            for own, user in zip(part.param_groups, self.part_groups(part_index, self.param_groups)):
                own.update({key: value for key, value in user.items() if key != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._copy_hyper_parameters()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("ZeroWithExperts partitions the groups it was built with; build the optimizer with "
                                  "every parameter group before the strategy shards it")

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("the states of ZeroWithExperts are saved by name: use "
                                  "lightning_par.checkpoint.format.optimizer_state_dict(module, optimizer)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("the states of ZeroWithExperts are loaded by name: load a checkpoint through the "
                                  "strategy")


__all__ = ["ZeroWithExperts"]
