"""A training step on fake tensors, with its memory by kind and its collectives by dimension.

The step is the one a run takes through the handle ``parallelize`` returned (docs/architecture.md, "The flow of a
run"): the pipeline runner's schedule, or the module's forward and loss inside the handle's loss context and
backward; then the handle's ``after_backward``, the optimizer's step and ``zero_grad``. The first step creates the
optimizer's states and is not measured; the second is, with torch's ``MemTracker`` (parameters, buffers, gradients,
optimizer states, activations and temporaries at the step's peak) and :class:`~lightning_par.dry_run.collectives.
CollectiveRecorder` (calls and bytes per mesh dimension). Nothing is allocated: every tensor is fake.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim import Optimizer
from torch.utils._python_dispatch import _disable_current_modes

from lightning_par.dry_run.collectives import CollectiveRecorder
from lightning_par.parallel.comm import CommTotals
from lightning_par.parallel.parallelized import Parallelized

__all__ = ["StepMemory", "StepReport", "measure_training_step"]

# Operations between two collections of the youngest generation in a measured step (_FixedCollections): each looks
# only at what they made, and the Python garbage of a long step (a 126-block stage) does not pile up meanwhile.
_COLLECT_EVERY = 1000
# MemTracker's kinds -> StepMemory's fields
_KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Optstate": "optimizer_states",
          "Activation": "activations", "Temp": "temporaries", "Other": "other", "Total": "peak"}


@dataclass
class StepMemory:
    """Bytes held at the step's peak, by kind (``peak`` is their sum)."""

    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    temporaries: int = 0
    other: int = 0
    peak: int = 0

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer states: what sharding divides."""
        return self.parameters + self.gradients + self.optimizer_states


class _StepPeakTracker(MemTracker):
    """torch's ``MemTracker`` for a step that runs a module's forward again before its backward (a pipeline's
    micro-batches): its statistics per module start afresh at each forward, and only the step's peak is kept (torch's
    tracker also updates every module's peak at every op: quadratic in the blocks, minutes for 126 of them). Python's
    cyclic garbage collector runs, while the step is measured, where :class:`_FixedCollections` runs it."""

    def __init__(self, *, track_modules: bool = True) -> None:
        super().__init__()
        if not track_modules:
            self._mod_tracker = _NoModules()
        self.collections = _FixedCollections(self._held)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if not self._mod_tracker.is_bw:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = super().__torch_dispatch__(func, types, args, kwargs)
        self.collections.operation_done()
        return result

    def _held(self) -> int:
        return sum(snapshot["Total"] for snapshot in self._curr_mem_snap.values())


class _FixedCollections:
    """Python's cyclic garbage collector during a measured step, run at points of the program only, so that the
    step's peak is the program's and not the interpreter's history's; ``freed`` counts the bytes of tensors it freed
    (``held``: the bytes the tracker counts held now).

    The tracker sees a fake tensor freed when Python frees it: at once when its last reference goes, or, for a
    tensor that a reference cycle holds, when the collector next runs. Left alone, the collector runs when counts of
    allocations that the whole process's past has set reach their thresholds: a rank forked from a server that
    imported torch collects at other moments than a fresh interpreter, and holds a cycle's tensors for another
    while. Here the step starts after a full collection, with the collector paused; every ``every`` operations the
    tracker sees, the youngest generation is collected (what was made since the last such point: the cycles that
    operations leave, cheaply), and at the step's end everything. Each collection then happens after the same
    operation and finds the same objects in any process. A tensor it frees was held in a cycle, counted held until
    then: ``freed`` says how much of the peak may be such."""

    def __init__(self, held: Callable[[], int], every: int = _COLLECT_EVERY) -> None:
        self._held, self.every = held, every
        self.freed, self._operations, self._paused, self._was_enabled = 0, 0, False, False

    def __enter__(self) -> _FixedCollections:
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        self._paused, self._operations = True, 0
        return self

    def operation_done(self) -> None:
        self._operations += 1
        if self._paused and self._operations % self.every == 0:
            self._collect(0)

    def __exit__(self, *exc: Any) -> None:
        self._collect(2)
        self._paused = False
        if self._was_enabled:
            gc.enable()

    def _collect(self, generation: int) -> None:
        before = self._held()
        gc.collect(generation)
        self.freed += before - self._held()


class _NoModules:
    """A ``ModTracker`` that follows no module. A schedule that splits each backward into an input-gradient pass
    (``torch.autograd.grad``) and a weight pass (ZB-V, DualPipeV) cannot run under torch's module tracker, whose
    backward hooks autograd refuses inside ``autograd.grad``: the step's memory is then measured without knowing
    forward from backward, every tensor an op makes counted as an activation (the peak and the model states are the
    same)."""

    is_bw = False
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module: nn.Module) -> str | None:
        return None

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


@dataclass
class StepReport:
    """What one training step of a rank held and moved."""

    peak: StepMemory  # at the step's peak
    states: StepMemory  # parameters, gradients and optimizer states after backward, before gradients are averaged
    collectives: dict[str, CommTotals]  # per mesh dimension
    cyclic: int = 0  # bytes of tensors only Python's cyclic collector freed: ``peak`` counts them until it did


def measure_training_step(handle: Parallelized, optimizer: Optimizer, mode: FakeTensorMode, *,
                          split_batch: Callable[[Tensor], tuple[Tensor, Tensor]],
                          loss_fn: Callable[[Tensor, Tensor], Tensor], batch: Tensor,
                          autocast: AbstractContextManager | None = None, splits_backward: bool = False) -> StepReport:
    """Take two training steps of ``handle`` on ``batch`` under ``mode`` (the fake mode its parameters were
    allocated in); report the second. A step whose shapes follow the values of the data (an MoE layer's tokens per
    expert) cannot run on fake tensors: refused with the module and the operation. ``splits_backward``: the
    pipeline's schedule splits each backward in two (``_NoModules``)."""
    recorder = CollectiveRecorder(handle.mesh)
    with mode:
        with _running_modules(handle.module) as running:
            try:
                _step(handle, optimizer, split_batch, loss_fn, batch, autocast, gradients_made=lambda: None)
            except (DynamicOutputShapeException, DataDependentOutputException) as error:
                inner = running[-1] if running else "the training step"
                raise ValueError(
                    f"{inner} runs {error}, whose output's shape or value follows the values of the data: fake "
                    "tensors have none, so a dry run cannot take this step (MoE routing is one such: the tokens each "
                    "expert gets). Check the layout without it (a dense model of the same sizes), and prove it with "
                    "lightning-par verify") from None
        tracker = _StepPeakTracker(track_modules=not splits_backward)
        tracker.track_external(handle.module, *_optimizers(optimizer))
        recorder.reset()
        states: list[StepMemory] = []
        with tracker, recorder, _shape_inference_untracked(), tracker.collections:
            _step(handle, optimizer, split_batch, loss_fn, batch, autocast,
                  gradients_made=lambda: states.append(_held_states(handle.module, optimizer)))
    return StepReport(peak=_memory(tracker.get_tracker_snapshot("peak")), states=states[0],
                      collectives=recorder.totals, cyclic=tracker.collections.freed)


@contextmanager
def _running_modules(root: nn.Module) -> Iterator[list[str]]:
    """The names of the modules whose forward is running, outermost first; a forward that raises stays on it."""
    names = {module: name or type(root).__name__ for name, module in root.named_modules(remove_duplicate=False)}
    running: list[str] = []

    def enter(module: nn.Module, args: Any) -> None:
        running.append(names.get(module, type(module).__name__))

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # not called when the forward raises
        running.pop()

    before, after = register_module_forward_pre_hook(enter), register_module_forward_hook(leave)
    try:
        yield running
    finally:
        before.remove()
        after.remove()


def _optimizers(optimizer: Optimizer) -> list[Optimizer]:
    """``optimizer`` and those it steps through (``ZeroRedundancyOptimizer.optim``, a list of partitions)."""
    found = [optimizer]
    for value in vars(optimizer).values():
        for inner in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(inner, Optimizer) and inner is not optimizer:
                found.extend(_optimizers(inner))
    return found


def _held_states(module: nn.Module, optimizer: Optimizer) -> StepMemory:
    """The bytes of this rank's parameters, gradients and optimizer states, each storage counted once."""
    seen: set[Any] = set()

    def size(tensors: Any) -> int:
        total = 0
        for tensor in tensors:
            local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
            if isinstance(local, Tensor) and local.untyped_storage()._cdata not in seen:
                seen.add(local.untyped_storage()._cdata)
                total += local.untyped_storage().nbytes()
        return total

    parameters = list(module.parameters())
    states = [value for inner in _optimizers(optimizer) for state in inner.state.values() for value in state.values()]
    return StepMemory(parameters=size(parameters), gradients=size(p.grad for p in parameters if p.grad is not None),
                      optimizer_states=size(states))


def _memory(snapshot: dict) -> StepMemory:
    by_kind = next(iter(snapshot.values()), {}) if snapshot else {}
    return StepMemory(**{field: int(by_kind.get(kind, 0)) for kind, field in _KINDS.items()})


@contextmanager
def _shape_inference_untracked() -> Iterator[None]:
    """DTensor learns an output's global shape by running the operation on fake tensors of the global shape
    (``ShardingPropagator._propagate_tensor_meta_non_cached``, on the fake mode it finds, which in a dry run is the
    step's own). A run's are fake and cost nothing; a dry run's tracker would count them with the step's real, local
    tensors (under loss parallel, two vocabulary-wide fp32 logits at the loss's backward). They run outside the
    step's modes instead, on a fake mode of their own."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: ShardingPropagator, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _step(handle: Parallelized, optimizer: Optimizer, split_batch: Callable[[Tensor], tuple[Tensor, Tensor]],
          loss_fn: Callable[[Tensor, Tensor], Tensor], batch: Tensor,
          autocast: AbstractContextManager | None, *, gradients_made: Callable[[], None]) -> None:
    inputs, targets = split_batch(batch)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    with autocast if autocast is not None else nullcontext():
        if handle.pipeline is not None:
            handle.pipeline.train_step(inputs, targets, parameters)
            handle.pipeline.take_gradients()
        else:
            with handle.loss_context():
                loss = loss_fn(handle.module(inputs), targets)
    if handle.pipeline is None:
        with handle.loss_context():
            loss.backward()
    gradients_made()  # before the handle averages them (and frees those another rank owns)
    handle.after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
