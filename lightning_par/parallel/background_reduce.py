"""ZeRO-3's gradient reduce-scatters on a CPU (gloo): all-reduces that run behind backward.

On a GPU, FSDP2 issues each block's reduce-scatter on a stream of its own, so the next block's backward computes
while it runs (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", section 4.3).
A CPU has no streams: FSDP2 calls the reduce-scatter with ``async_op=False`` and the host waits for every rank at
each block. gloo makes that wait long: its reduce-scatter of a 5.8 MB block took 7.2 ms with SUM and 12.8 ms with
AVG (FSDP2's op) where an all-reduce of the same buffer took 6.4 ms, on 2 ranks of this project's CI machine.

:class:`BackgroundReduceScatter` is FSDP2's own extension point for that call (``set_custom_reduce_scatter``). It
sums the whole gradient buffer with an asynchronous all-reduce (in place: FSDP2 no longer needs its input), and
takes this rank's shard out of it, divided for AVG, when the result is needed: at the end of backward (an autograd
final callback), or when more than ``max_in_flight`` are pending, so that the unsharded gradient buffers held for
them stay bounded (as FSDP2's ``reduce_scatter_max_input_buffers`` bounds them on a GPU).

Deferring is exact only where FSDP2 does not read the output right after the call, so each call checks what FSDP2
is about to do with it and finishes at once otherwise: an accumulating gradient (``+=``), a cast from
``reduce_dtype``, a division after a sum (``op`` SUM: forced sums, fp16), and gradient hooks that read the new
shard. HSDP does not use it (its all-reduce across replicas follows on the output at once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # an older torch: FSDP2 without custom collectives keeps its own synchronous reduce-scatter
    DefaultReduceScatter = object  # type: ignore[assignment,misc]

SUPPORTED = DefaultReduceScatter is not object and hasattr(FSDPModule, "set_custom_reduce_scatter")


class BackgroundReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter for one unit on gloo: an all-reduce, in the background where FSDP2 allows it.

    ``pending`` is shared by the units of one model, so that ``max_in_flight`` bounds them all together.
    """

    def __init__(self, unit: nn.Module | list[nn.Module], pending: list[Callable[[], None]],
                 max_in_flight: int = 2) -> None:
        members = unit if isinstance(unit, list) else [unit]  # FSDP2 shards a list of modules as one unit
        nested = {p for member in members for sub in member.modules()
                  if sub not in members and isinstance(sub, FSDPModule) for p in sub.parameters()}
        self.params = [p for member in members for p in member.parameters() if p not in nested]  # the unit's shards
        self.pending = pending
        self.max_in_flight = max_in_flight

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> Any:
        divide = op == dist.ReduceOp.AVG
        if async_op or not (divide or op == dist.ReduceOp.SUM):  # PREMUL_SUM and the like: FSDP2's own call
            self.wait()
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        while len(self.pending) >= self.max_in_flight:
            self.pending.pop(0)()
        work = dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        world = dist.get_world_size(group)
        shard = input_tensor.view(world, -1)[dist.get_rank(group)]

        def finish() -> None:
            work.wait()
            if divide:  # one pass over the shard
                torch.div(shard, world, out=output_tensor)
            else:
                output_tensor.copy_(shard)

        if not self._output_left_alone(output_tensor, op) or not self._finish_when_backward_ends():
            finish()
            return None
        self.pending.append(finish)  # holds the input and the output until then
        return None

    def _output_left_alone(self, output: Tensor, op: Any) -> bool:
        """Whether FSDP2 only views ``output`` as the new sharded gradients after this call."""
        if op == dist.ReduceOp.SUM:  # FSDP2 then divides in place (by the world size or its own factor)
            return False
        return all(p.grad is None and p.dtype == output.dtype and not getattr(p, "_post_accumulate_grad_hooks", None)
                   for p in self.params)

    def _finish_when_backward_ends(self) -> bool:
        try:  # queued for every deferral: a backward that raised may have left pending ones without their callback
            Variable._execution_engine.queue_callback(self.wait)
        except RuntimeError:  # not inside a backward: "Final callbacks can only be installed during backward pass"
            return False
        return True

    def wait(self) -> None:
        """Finish every pending reduction, oldest first."""
        while self.pending:
            self.pending.pop(0)()


__all__ = ["BackgroundReduceScatter", "SUPPORTED"]
