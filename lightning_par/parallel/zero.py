"""ZeRO stages 1-3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models") on PyTorch's own pieces.

Model states of pure-fp32 Adam take 16 bytes per parameter: 4 weights, 4 gradients, 8 moments.
Over N data-parallel ranks:

- stage 1 shards the optimizer states: ``4 + 4 + 8/N``. Gradients are all-reduced whole by DDP;
  PyTorch's ``ZeroRedundancyOptimizer`` gives each rank the moments of the parameters it owns, steps
  them, and broadcasts the updated parameters.
- stage 2 shards gradients too: ``4 + (4 + 8)/N``. Instead of an all-reduce, the gradients are reduced
  to the rank that owns their parameters, in buckets, as backward produces them, and dropped elsewhere
  (DeepSpeed's stage 2: parameters stay whole all the time). Same sharded optimizer.
- stage 3 shards the parameters as well: ``16/N``. FSDP2's ``fully_shard`` per transformer block (from
  the model map) plus the root: a block's parameters are all-gathered just before it runs and freed
  after (``reshard_after_forward=False`` keeps them until backward instead, trading memory for one
  all-gather; ``keep_gathered_blocks=N`` does so for the last N blocks only, which backward needs first).
  ``prefetch_blocks=N`` issues the all-gathers of the next N blocks when a block starts, in forward and in
  backward (FSDP2's explicit prefetching) instead of FSDP2's own single-block lookahead. ``blocks_per_unit=K``
  makes every K consecutive blocks one unit (FSDP2's ``fully_shard`` of a list of modules): one all-gather and one
  reduce-scatter per unit, K times fewer collectives and hooks for K blocks gathered at once and one unit's whole
  gradients held until its reduce-scatter (FSDP1's size-based wrapping, DeepSpeed's prefetch buckets). With
  ``dp_replicate > 1`` this is HSDP: sharded inside a group, replicated across groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_par.layout.zero_stages import ZeroStage
from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.background_reduce import SUPPORTED, BackgroundReduceScatter
from lightning_par.parallel.experts import expert_modules, local_part
from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.buckets import average_in_buckets, local_tensor
from lightning_par.parallel.ddp import GRADIENT_GROUP
from lightning_par.parallel.modules import is_expert
from lightning_par.parallel.record import layout_record
from lightning_par.parallel.shared_parts import shared_parts
from lightning_par.parallel.zero_experts import ZeroWithExperts

# The ranks over which ZeRO-1 and -2 partition optimizer states and gradients: the gradient group without its
# replicated groups (HSDP), so context-parallel ranks too (Megatron-Core's distributed optimizer shards over data x
# context parallel).
PARTITION_GROUP = "dp_shard_cp"


def fully_shard_model(module: nn.Module, mesh: ParallelMesh, model_map: ModelMap | None, *,
                      reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype | None = None, cpu_offload: bool = False,
                      root: bool = True, keep_gathered_blocks: int = 0, prefetch_blocks: int = 0,
                      blocks_per_unit: int = 1,
                      stage_blocks: Sequence[Sequence[nn.Module]] | None = None,
                      blocks_used_outside: Sequence[str] = ()) -> Callable[[nn.Module], None]:
    """ZeRO-3: shard every block of ``model_map`` with FSDP2, then the root (embedding, norm, head, the rest).

    Without a model map the whole model is one unit: still sharded at rest, but gathered whole for forward.
    Experts split by expert parallel are units of their own, sharded over the ranks that hold the same experts
    (:meth:`ParallelMesh.experts`; torchtitan's EP x FSDP), while the rest of their block is sharded over all of
    ``dp_shard x cp``.
    ``keep_gathered_blocks``, ``prefetch_blocks`` and ``blocks_per_unit``: see the module's docstring (prefetching
    only where the blocks run in one sequence: not across pipeline stages). With units of several blocks, a unit
    stays gathered when all its blocks are among the last ``keep_gathered_blocks``, and prefetching reaches as many
    units ahead as cover ``prefetch_blocks`` blocks.
    ``param_dtype`` casts the gathered parameters for compute (the shards, and so the optimizer, stay
    fp32); gradients are reduced in ``reduce_dtype``. ``cpu_offload`` keeps shards, gradients and
    optimizer states in host memory and copies each block to the accelerator when it runs (on a CPU run
    everything already lives there, and FSDP2's offload needs an accelerator, so it is skipped).

    ``stage_blocks``: under pipeline parallel, this rank's blocks by stage; a unit never spans two stages (each
    stage is a root of its own).

    ``blocks_used_outside``: names of blocks whose parts the network also calls outside the block
    (``lightning_par.parallel.outside_calls``): not units of their own, their parameters join the root's unit.
    A part that several blocks hold (``lightning_par.parallel.shared_parts``: a shared transformer block) is a unit
    of its own, gathered each time a block runs it.

    Returns the function that shards a root with the same settings. With ``root=False`` the module itself is
    left to the caller: under pipeline parallel each pipeline stage is a root (torchtitan's PP x FSDP), and
    ``torch.distributed.pipelining`` then keeps the blocks gathered and the gradients whole over the micro-batches
    of a step, reduce-scattering them once after the last.
    """
    fsdp_mesh = _fsdp_mesh(mesh)
    options: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload and mesh.device_type != "cpu":
        options["offload_policy"] = CPUOffloadPolicy()
    # On a CPU each reduce-scatter would block the host (no streams): run them behind backward instead. Not under
    # HSDP, whose all-reduce across replicas reads each reduce-scatter's output at once.
    background: list[Any] | None = [] if mesh.device_type == "cpu" and fsdp_mesh.ndim == 1 and SUPPORTED else None

    def shard(unit: list[nn.Module], unit_mesh: Any, reshard: bool) -> None:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=unit_mesh, reshard_after_forward=reshard, **options)
        if background is not None and unit_mesh.ndim == 1:  # (a unit's modules share one FSDP2 state)
            unit[0].set_custom_reduce_scatter(BackgroundReduceScatter(unit, background))

    for experts in expert_modules(module):  # inner units first: a block's unit takes what is left
        ep = next(experts.parameters()).device_mesh.size()
        shard_mesh = mesh.experts(ep).shard
        shard([experts], shard_mesh, reshard_after_forward)
        # The all-to-all already summed each expert's gradient over the tokens of its ep group; what is left is
        # the average over every data-parallel rank, as for any other gradient, not over the ranks sharding it.
        experts.set_gradient_divide_factor(mesh.size("dp_cp"))
        if mesh.device_type == "cpu" and shard_mesh.size(shard_mesh.ndim - 1) > 1:
            # gloo has no pre-multiplied sum: sum, then divide. (Not with one shard: FSDP2 then divides while
            # copying instead of reduce-scattering, and would divide a second time.)
            experts.set_force_sum_reduction_for_comms(True)
    if model_map is not None:
        container = model_map.blocks
        layers = [(f"{container}.{name}", block) for name, block in module.get_submodule(container).named_children()
                  if next(block.parameters(), None) is not None]  # not the stand-ins for other pipeline ranks' blocks
        # A part several layers hold (a shared transformer block) is one unit of its own, gathered each time a layer
        # runs it: FSDP2 manages a parameter in one unit only. Inner units first: the layers' units take the rest.
        parts = shared_parts(layers)
        for part in parts:
            shard(list(part.modules), fsdp_mesh, reshard_after_forward)
        in_parts = {id(m) for part in parts for m in part.modules}
        blocks = [block for name, block in layers if name not in blocks_used_outside and id(block) not in in_parts]
        runs = [blocks] if stage_blocks is None else [[b for b in blocks if any(b is s for s in stage)]
                                                      for stage in stage_blocks]
        units = [run[first:first + blocks_per_unit] for run in runs for first in range(0, len(run), blocks_per_unit)]
        kept_from, position = len(blocks) - keep_gathered_blocks, 0  # a unit stays gathered when its blocks are kept
        for unit in units:
            shard(unit, fsdp_mesh, reshard_after_forward and position < kept_from)
            position += len(unit)
        heads = [unit[0] for unit in units]  # (each stands for its unit in FSDP2's prefetch lists)
        prefetch_units = -(-prefetch_blocks // blocks_per_unit)
        if prefetch_units and root:
            prefetch_ahead(heads, prefetch_units, background=mesh.device_type == "cpu")

    def shard_root(root_module: nn.Module) -> None:
        # A root keeps its parameters gathered after forward: backward starts with them (head, norm) anyway.
        shard([root_module], fsdp_mesh, False)

    if root:
        shard_root(module)
        if model_map is not None and prefetch_units:  # the first blocks gather while the embedding runs
            module.set_modules_to_forward_prefetch(heads[:prefetch_units])
    return shard_root


def prefetch_ahead(units: list[nn.Module], depth: int, *, background: bool = False) -> None:
    """Each FSDP2 unit, when it starts, issues the all-gathers of the ``depth`` units that run after it: the next
    ones in forward, the previous ones in backward (which runs them in reverse).

    ``background``: issue every unit's own gather asynchronously as well. On a GPU FSDP2 overlaps its gathers on a
    stream of their own; on a CPU there is none, and a gather issued synchronously waits for every rank at once, so
    a prefetch would only move the wait (FSDP2's ``_set_unshard_async_op``, its documented pairing with explicit
    prefetching)."""
    for index, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[index + 1:index + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(index - depth, 0):index][::-1])
        if background:
            unit._set_unshard_async_op(True)


def _fsdp_mesh(mesh: ParallelMesh) -> Any:
    # 1-D: plain FSDP over the sharding ranks; 2-D (replicate, shard): HSDP. Context-parallel ranks shard
    # too (as in torchtitan): they hold the same parameters and their gradients are averaged with the rest.
    if mesh.size("dp_replicate") > 1:
        return mesh.root["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


class GradientReducer:
    """ZeRO-2 gradient partitioning: reduce each gradient to the rank owning its parameter, drop it elsewhere.

    Runs from ``post_accumulate_grad`` hooks: as backward finishes accumulating gradients, they are packed into one
    bucket per owner, and a bucket is reduced to its owner, asynchronously, as soon as it holds ``bucket_bytes``
    (DeepSpeed's ``reduce_bucket_size``: one collective, with its fixed cost, per bucket instead of per parameter),
    overlapping the rest of backward. When backward ends the part-filled buckets are
    reduced too, the reductions are waited for, owners copy the sums back, and non-owners free their copies (so
    whole gradients coexist only until then). Under HSDP the owner also averages across the replicate groups.
    ``owners``: each parameter's owner, a rank of ``PARTITION_GROUP``; ``unowned``: parameters whose gradients
    another mechanism reduces (experts) and another rank steps, dropped when backward ends.
    While gradients accumulate (``sync`` off) each rank keeps its whole local sum and reduces it once, on the last
    micro-batch; with ``sharded`` it reduces on every micro-batch instead, and the owner keeps the running sum
    aside, so no rank holds more than its part between micro-batches.

    Every rank's hooks fire in the same order (the same graph), so every rank launches the same buckets in the
    same order, as collectives need.
    """

    def __init__(self, owners: dict[Tensor, int], mesh: ParallelMesh, *, unowned: Sequence[Tensor] = (),
                 sharded: bool = False, bucket_bytes: int = 4 * 2**20) -> None:
        self.shard_group = mesh.group(PARTITION_GROUP)
        self.replicate_group = mesh.group("dp_replicate") if mesh.size("dp_replicate") > 1 else None
        self.world = mesh.size(GRADIENT_GROUP)
        self.sync = True
        self.sharded = sharded
        self.bucket_bytes = bucket_bytes
        self._accumulated: dict[Tensor, Tensor] = {}  # sharded: the owner's reduced sum of earlier micro-batches
        self._filling: dict[int, list[Tensor]] = {}  # owner -> parameters whose gradients wait in its bucket
        self._in_flight: list[tuple[Any, Tensor, list[Tensor], int]] = []  # (work, flat bucket, parameters, owner)
        self._backward = -1  # the autograd graph task whose gradients the buckets hold
        self.unowned = list(unowned)  # reduced elsewhere (experts): dropped after backward
        self.rank = dist.get_rank(self.shard_group)
        self._handles = [param.register_post_accumulate_grad_hook(self._hook(owner))
                         for param, owner in owners.items() if param.requires_grad]

    def _hook(self, owner: int) -> Any:
        def add_to_bucket(param: Tensor) -> None:
            if not self.sync and not self.sharded:
                return  # accumulating: keep the local sum, reduce on the last micro-batch
            backward = torch._C._current_graph_task_id()
            if backward != self._backward:  # the first gradient of this backward (a failed one may have left some)
                self._backward, self._filling, self._in_flight = backward, {}, []
                Variable._execution_engine.queue_callback(self._settle)
            bucket = self._filling.setdefault(owner, [])
            bucket.append(param)
            if sum(local_part(p.grad).numel() * p.grad.element_size() for p in bucket) >= self.bucket_bytes:
                self._launch(owner)

        return add_to_bucket

    def _launch(self, owner: int) -> None:
        """Reduce the bucket of ``owner`` to it, asynchronously (the rest of backward runs meanwhile)."""
        params = self._filling.pop(owner)
        grads = [local_part(p.grad) for p in params]  # a tensor-parallel shard reduces as its local piece
        flat = grads[0] if len(grads) == 1 else torch._utils._flatten_dense_tensors(grads)
        work = dist.reduce(flat, dst=dist.get_global_rank(self.shard_group, owner), group=self.shard_group,
                           async_op=True)
        self._in_flight.append((work, flat, params, owner))

    def _settle(self) -> None:
        """At the end of backward: reduce what is left in the buckets, wait for the reductions; owners average (across
        replicas too), the others drop their copies (the point of stage 2: only the owner keeps a gradient)."""
        for owner in sorted(self._filling):  # the same order on every rank
            self._launch(owner)
        in_flight, self._in_flight, self._backward = self._in_flight, [], -1
        for param in self.unowned:
            param.grad = None
        for work, flat, params, owner in in_flight:
            work.wait()
            if self.rank != owner:
                for param in params:
                    param.grad = None
                continue
            # Average the whole bucket (one all-reduce across replicas per bucket, not per parameter), then unpack
            # it, as reduce_gradients_to_owners does.
            if self.replicate_group is not None:
                dist.all_reduce(flat, group=self.replicate_group)
            flat.div_(self.world)
            if len(params) > 1:
                grads = [local_part(p.grad) for p in params]
                for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    grad.copy_(reduced)
            if self.sharded:
                for param in params:
                    self._accumulate(param)

    def _accumulate(self, param: Tensor) -> None:
        """Sharded accumulation: the owner keeps the running sum of the micro-batches' reduced gradients aside."""
        keep_reduced_sum(param, self._accumulated, last=self.sync)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def keep_reduced_sum(param: Tensor, aside: dict[Tensor, Tensor], *, last: bool) -> None:
    """An owner's side of accumulating reduced gradients: before the ``last`` micro-batch, add ``param``'s reduced
    gradient to the sum kept in ``aside`` and drop it (the next backward starts from none); on the last, add the sum
    kept back in."""
    earlier = aside.pop(param, None)
    if not last:
        aside[param] = param.grad if earlier is None else earlier + param.grad
        param.grad = None
    elif earlier is not None:
        param.grad = earlier + param.grad


def shard_optimizer(optimizer: Optimizer, module: nn.Module, mesh: ParallelMesh, *, stage: ZeroStage,
                    sharded_accumulation: bool = False, reduce_in_backward: bool = True) -> Optimizer:
    """Stages 1 and 2 (the rows of ``layout/zero_stages.py`` that shard optimizer states and keep parameters whole):
    the same optimizer, its states partitioned over the sharding ranks.

    Returns a ``ZeroRedundancyOptimizer`` built from ``optimizer``'s class, parameter groups and defaults, or, for a
    model with experts split by expert parallel, a :class:`~.zero_experts.ZeroWithExperts` of two (the experts'
    states partitioned over the ranks holding the same experts).
    A stage that reduces gradients to their owners (2) also installs the :class:`GradientReducer` (kept in the
    module's layout record), reducing on every micro-batch with ``sharded_accumulation``; not with
    ``reduce_in_backward=False`` (pipeline stages, whose schedule runs the backward: the caller reduces to the owners
    after it).
    """
    if not stage.shards_optimizer_states or stage.shards_parameters:  # none, or FSDP2's own sharded states
        return optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ValueError("the optimizer is already a ZeroRedundancyOptimizer; return a plain one from "
                         "configure_optimizers and let the strategy shard it")
    if optimizer.state:
        raise ValueError("shard_optimizer() needs a fresh optimizer (its state is not empty)")
    groups = [dict(group) for group in optimizer.param_groups]
    # `defaults` can hold entries the constructor does not take (AdamW records decoupled_weight_decay).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    # Plain parameters are packed into one flat bucket per owner, so that an owner broadcasts its updated parameters
    # in one collective instead of one per parameter (halved the optimizer step on an 8-block model); DTensor shards
    # cannot be viewed into a plain bucket.
    def partition(part: list[dict[str, Any]], experts: bool) -> ZeroRedundancyOptimizer:
        bucketed = not any(isinstance(p, DTensor) for group in part for p in group["params"])
        group = mesh.experts(_expert_parallel_size(part)).partition.get_group() if experts else \
            mesh.group(PARTITION_GROUP)
        return _ZeroOverShards(part, optimizer_class=type(optimizer), process_group=group,
                               parameters_as_bucket_view=bucketed, **defaults)

    if any(is_expert(p) for group in groups for p in group["params"]):
        sharded: Optimizer = ZeroWithExperts(groups, partition, is_expert)
    else:
        sharded = partition(groups, False)
    if stage.gradient_reduction == "to owners" and reduce_in_backward:
        record = layout_record(module, create=True)
        if record.gradient_reducer is not None:
            record.gradient_reducer.remove()
        owners, unowned = partition_of(sharded)
        record.gradient_reducer = GradientReducer(owners, mesh, unowned=unowned, sharded=sharded_accumulation)
    return sharded


@torch.no_grad()
def reduce_gradients_to_owners(module: nn.Module, mesh: ParallelMesh, owners: dict[torch.Tensor, int], *,
                               bucket_cap_mb: float = 25.0) -> None:
    """ZeRO-1's gradient average after the last backward (Megatron-LM's distributed optimizer): each gradient is
    reduced to the data-parallel rank whose optimizer steps it, ``owners[parameter]`` (a rank of ``PARTITION_GROUP``),
    averaged there (and across ``dp_replicate``), and dropped elsewhere. Half the bytes of the all-reduce of
    :func:`~lightning_par.parallel.ddp.reduce_gradients`, which together with the owners' broadcast of the updated
    parameters makes what an all-reduce costs; the gradients are bucketed by owner as there. Expert gradients are
    left alone, as there."""
    if mesh.size(GRADIENT_GROUP) == 1:
        return
    shard_group, replicate = mesh.group(PARTITION_GROUP), mesh.size("dp_replicate")
    me, ranks = dist.get_rank(shard_group), mesh.size(GRADIENT_GROUP)
    by_owner: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for p in module.parameters():
        if p.grad is not None and not is_expert(p):
            by_owner.setdefault((owners[p], local_tensor(p.grad).dtype), []).append(p)
    # Every rank holds the same parameters in the same order, so the groups come in the same order everywhere.
    for (owner, _), params in by_owner.items():

        def reduce_to_owner(flat: torch.Tensor) -> bool:
            dist.reduce(flat, dst=dist.get_global_rank(shard_group, owner), group=shard_group)
            if owner == me and replicate > 1:
                dist.all_reduce(flat, group=mesh.group("dp_replicate"))
            return owner == me

        average_in_buckets([local_tensor(p.grad) for p in params], bucket_cap_mb, reduce_to_owner, ranks)
        if owner != me:
            for p in params:
                p.grad = None  # another rank steps this parameter: its gradient is of no use here


def partition_of(optimizer: Optimizer) -> tuple[dict[Tensor, int], list[Tensor]]:
    """A ZeRO-1/2 optimizer's partition: each dense parameter's owner (a rank of ``PARTITION_GROUP``), and the expert
    parameters this rank does not step (their gradients, reduced by expert parallel, are of no use here)."""
    if isinstance(optimizer, ZeroWithExperts):
        return (dict(optimizer.dense._param_to_rank),
                [p for p in optimizer.experts._param_to_rank if not optimizer.owns(p)])
    return dict(optimizer._param_to_rank), []


def _expert_parallel_size(groups: list[dict[str, Any]]) -> int:
    return next(p for group in groups for p in group["params"]).device_mesh.size()


class _ZeroOverShards(ZeroRedundancyOptimizer):
    """torch's ``ZeroRedundancyOptimizer`` for parameters that may be DTensors (tensor-parallel shards: ZeRO-1 with
    tp, Megatron's distributed optimizer). Owners step whole DTensors, as any optimizer does under tensor parallel;
    what differs is the broadcast of the updated parameters: c10d has no DTensor rule for it, and each data-parallel
    rank holds the same local shard, so the owner broadcasts its local shard into the others' in place."""

    def _broadcast_params_from_rank(self, rank: int) -> list[Any]:
        params = [param for group in self._partition_parameters()[rank] for param in group["params"]]
        if self.parameters_as_bucket_view or not any(isinstance(param, DTensor) for param in params):
            return super()._broadcast_params_from_rank(rank)
        source = dist.get_global_rank(self.process_group, rank)
        return [dist.broadcast(local_part(param.data), src=source, group=self.process_group, async_op=True)
                for param in params]


@contextmanager
def no_reduction(module: nn.Module, *, sharded: bool = False) -> Iterator[None]:
    """Backward passes inside the context accumulate gradients for a later step (ZeRO stages 2 and 3): whole, and
    reduced once after the context; or, ``sharded``, reduced on every backward so that they stay sharded
    (FSDP2 then reduce-scatters as usual and sums into the sharded gradients; stage 2's reducer keeps the sum)."""
    reducer: GradientReducer | None = _gradient_reducer(module)
    if isinstance(module, FSDPModule) and sharded:
        yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    elif reducer is not None:
        reducer.sync = False
        try:
            yield
        finally:
            reducer.sync = True
    else:
        yield


def is_zero_module(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule) or _gradient_reducer(module) is not None


def _gradient_reducer(module: nn.Module) -> GradientReducer | None:
    record = layout_record(module)
    return record.gradient_reducer if record is not None else None



__all__ = [
    "PARTITION_GROUP",
    "fully_shard_model",
    "reduce_gradients_to_owners",
    "shard_optimizer",
    "GradientReducer",
    "no_reduction",
    "is_zero_module",
]
