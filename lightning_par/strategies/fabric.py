"""Every lightning_par layout under Lightning Fabric: ``L.Fabric(strategy="hybrid3d", ...)`` (docs/fabric.md).

A Fabric strategy holds the Trainer strategy of the same name (its ``trainer_strategy``) and lets it do what does not
depend on who drives the loop: read and check the arguments, start the processes (with the fault monitor), build the
mesh, lay the model out (``MeshStrategy.lay_out``: the same ``parallelize`` call, the same ``Parallelized`` handle).
What Fabric's loop asks goes to that handle: ``fabric.backward`` (in the loss context, then ``after_backward``),
``fabric.no_backward_sync`` (``no_sync``), ``fabric.clip_gradients`` (the norm of the whole gradient),
``fabric.save``/``fabric.load`` (``lightning_par/checkpoint/format.py``: the Trainer's format, so either loads the
other's). Under pipeline parallel a step is one call, :meth:`MeshFabricStrategy.pipeline_step`, which runs the
schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import ReduceOp, _sync_ddp_if_available
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.checkpoint import format as ckpt
from lightning_par.checkpoint.object_store import location
from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.compose import runs_on_a_sample
from lightning_par.parallel.model_call import ModelCall
from lightning_par.parallel.model_map import ModelMap
from lightning_par.parallel.modules import clean_name, tied_aliases
from lightning_par.parallel.parallelized import Parallelized
from lightning_par.strategies.base import MeshStrategy, point_scheduler_at
from lightning_par.strategies.processes import DevicesOfTheRun, launched_ranks_grace, start_ranks
from lightning_par.strategies import (context_parallel, data_parallel, expert_parallel, hybrid3d, pipeline_parallel,
                                      tensor_parallel, zero)


class _FabricSubprocessLauncher(_SubprocessScriptLauncher):
    """Fabric's subprocess launcher, its ranks watched as the Trainer's are
    (:class:`~lightning_par.strategies.processes.LaunchedRanksObserver`)."""

    def __init__(self, *args: Any, grace: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grace = grace

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        start_ranks(self, self._grace)
        return function(*args, **kwargs)


class MeshFabricStrategy(DevicesOfTheRun, ParallelStrategy):
    """A lightning_par layout for ``L.Fabric``: the arguments of its :attr:`trainer_strategy_class`."""

    #: The Trainer strategy whose arguments, names and layout this strategy takes.
    trainer_strategy_class: type[MeshStrategy] = MeshStrategy

    def __init__(self, *args: Any, accelerator: Any = None, checkpoint_io: Any = None, precision: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.trainer_strategy = self.trainer_strategy_class(*args, **kwargs)
        self._parallelized: Parallelized | None = None
        self._in_schedule = False  # inside pipeline_step / pipeline_evaluate
        self._backward_sync_control = _NoSyncThroughTheHandle(self)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register every name the Trainer strategy registers, with the same arguments."""
        cls.trainer_strategy_class.register_strategies(_RegisteredAs(cls, strategy_registry))

    # ------------------------------------------------------------------------------------------ processes
    @property
    def parallel_config(self) -> ParallelConfig:
        """The layout this run trains in (sizes checked against the world size once the processes started)."""
        return self.trainer_strategy.parallel_config

    @property
    def mesh(self) -> Any:
        """The named device mesh (``lightning_par.parallel.mesh.ParallelMesh``), from ``fabric.launch()`` on."""
        return self.trainer_strategy.mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The device mesh, with Lightning's dimension names too (``data_parallel``, ``tensor_parallel``)."""
        return self.mesh.root

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            grace = launched_ranks_grace(self.trainer_strategy._timeout)
            self._launcher = _FabricSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                                       grace=grace)

    def _hand_over(self) -> None:
        """Give the Trainer strategy held what Fabric set on this one: devices, nodes, cluster, launcher."""
        trainer_strategy = self.trainer_strategy
        trainer_strategy.cluster_environment = self.cluster_environment
        trainer_strategy.parallel_devices = self.parallel_devices
        trainer_strategy.num_nodes = self.num_nodes
        trainer_strategy._launcher = self._launcher

    def _set_world_ranks(self) -> None:
        self._hand_over()
        self.trainer_strategy.set_world_ranks()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._hand_over()
        planned = sorted(getattr(self.trainer_strategy, "_planned", ()))
        if planned:  # the planner reads the model and its data, which Fabric has not seen when the processes start
            raise ValueError(f"{type(self).__name__}: {', '.join(planned)} left 'auto', and under Fabric the layout "
                             "is fixed when the processes start, before the model exists: give every size (the "
                             "command `lightning-par plan` proposes them), or use the Trainer, which plans from the "
                             "model")
        self.trainer_strategy.start_processes_and_mesh()

    @override
    def teardown(self) -> None:
        self.trainer_strategy._finish_pending_save()
        self.trainer_strategy.stop_watching()
        super().teardown()

    # ------------------------------------------------------------------------------------------ model
    @property
    def parallelized(self) -> Parallelized:
        """What ``parallelize()`` made of the model set up (``fabric.setup``): the handle each step asks."""
        if self._parallelized is None:
            raise RuntimeError(f"{type(self).__name__}.parallelized is made when the model is set up (fabric.setup)")
        return self._parallelized

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # `fabric.init_module(empty_init=True)`: built on the meta device, allocated by parallelize() (after sharding).
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not any(p.is_meta for p in module.parameters()):
            module.to(self.root_device)  # a meta-device model is allocated on the device by parallelize()

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        # The optimizers were built on the parameters as they were before the layout replaced them (DTensors,
        # FSDP2's shards, a pipeline rank's stages): they are pointed at the new ones, by name.
        names = {p: clean_name(name) for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        now = {clean_name(name): p for name, p in self.parallelized.inner.named_parameters(remove_duplicate=False)}
        set_up = [self.setup_optimizer(_on_parameters(optimizer, names, now)) for optimizer in optimizers]
        if scheduler is not None:
            for original, replacement in zip(optimizers, set_up):
                if scheduler.optimizer is original:
                    point_scheduler_at(scheduler, replacement)
        return module, set_up, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._parallelized is not None:
            raise ValueError(f"{type(self).__name__} lays out one model per run, and one is set up already; a second "
                             "model needs a Fabric of its own")
        try:
            self._parallelized = self.trainer_strategy.lay_out(
                module, module, training=True, accumulate=1,
                sample=lambda config, model_map: self._sample(module, config, model_map))
        except ValueError as refusal:  # parallel/ refuses with the fields' names: say them as the user wrote them
            self.parallel_config.spelling.spell_error(refusal)
            raise
        if self._parallelized.pipeline is not None:
            self._parallelized.module.register_forward_pre_hook(self._refuse_forward_outside_schedule)
        return self._parallelized.module

    def _sample(self, module: nn.Module, config: ParallelConfig,
                model_map: ModelMap | None) -> tuple[Tensor, None] | ModelCall | None:
        """The model's ``example_input_array`` (rank 0's, on every rank), where the layout runs the model at set-up
        (``runs_on_a_sample``, as for the Trainer). One micro-batch of it under pipeline parallel. A tuple is the
        forward's positional inputs and a dict its keyword inputs (Lightning's convention): the set-up calls the model
        with them."""
        if not runs_on_a_sample(module, config, model_map):
            return None
        example = getattr(module, "example_input_array", None)
        if example is None or not isinstance(example, (Tensor, tuple, list, dict)):
            if model_map is not None and (config.tp > 1 or config.pp > 1):
                needs = (f"{config.named('tp')}: the tensor-parallel split is checked" if config.tp > 1 else
                         f"{config.named('pp')}: the code outside the blocks is placed on its stage by tracing the "
                         "model")
                raise ValueError(f"{needs} on a sample input before training, and {type(module).__name__} has none: "
                                 "set model.example_input_array = <a batch of inputs> (token ids of shape [batch, "
                                 "sequence]; a tuple or dict of the forward's inputs) before fabric.setup")
            return None
        example = move_data_to_device(self.trainer_strategy.broadcast(move_data_to_device(example, "cpu")),
                                      self.root_device)
        if isinstance(example, Tensor):
            if config.pp > 1:
                example = example[: max(1, example.shape[0] // config.microbatches)]
            return example, None
        args, kwargs = (tuple(example), {}) if isinstance(example, (tuple, list)) else ((), dict(example))
        return ModelCall.first_tensor_as_inputs("", args, kwargs)

    def _refuse_forward_outside_schedule(self, module: nn.Module, args: Any) -> None:
        if not self._in_schedule:
            raise RuntimeError(f"pipeline parallel ({self.parallel_config.named('pp')}): this rank holds some stages "
                               "of the model, so the model cannot be called whole. A training step is one call that "
                               "runs the schedule: loss = fabric.strategy.pipeline_step(model, batch, loss_fn) "
                               "(forward, loss and backward of every micro-batch); evaluation is "
                               "fabric.strategy.pipeline_evaluate(model, batch, loss_fn)")

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return self.parallelized.shard_optimizer(optimizer)

    # ------------------------------------------------------------------------------------------ steps
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.parallelized.pipeline is not None:
            raise RuntimeError("pipeline parallel: fabric.strategy.pipeline_step(model, batch, loss_fn) runs backward "
                               "inside the schedule and leaves the gradients in place; do not call fabric.backward")
        with self.parallelized.loss_context():
            super().backward(tensor, module, *args, **kwargs)
        self.parallelized.after_backward()

    def loss_context(self) -> AbstractContextManager:
        """Where a loss on the model's output must be computed: with ``loss_parallel``, on vocabulary-split logits
        (``fabric.backward`` enters it by itself)."""
        return self.parallelized.loss_context()

    def pipeline_step(self, model: nn.Module, batch: Any, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                      *, accumulate: int = 1) -> Tensor:
        """One training step under pipeline parallel: forward, ``loss_fn(logits, targets)`` and backward of every
        micro-batch of ``batch``, in the configured schedule; returns the batch's mean loss on every rank.

        ``batch`` is ``(inputs, targets)``, or what the model's ``split_batch(batch)`` turns into them.
        ``loss_fn`` is the mean loss of a micro-batch (by default the model's ``loss_fn``). Gradients are added to
        the parameters as a backward would (inside ``fabric.no_backward_sync`` they are not yet reduced);
        ``accumulate`` is the number of batches one optimizer step sums, each weighing ``1 / accumulate``."""
        runner = self._runner(model, loss_fn)
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate}: the batches of one optimizer step; use 1 or more")
        inner = self.parallelized.inner
        inputs, targets = _inputs_and_targets(inner, batch)
        runner.accumulate = accumulate
        self._in_schedule = True
        try:
            loss = runner.train_step(inputs, targets, list(inner.parameters()))
        finally:
            self._in_schedule = False
        runner.take_gradients()
        self.parallelized.after_backward()
        return loss

    def pipeline_evaluate(self, model: nn.Module, batch: Any,
                          loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
        """The mean loss of ``batch`` (as :meth:`pipeline_step` reads it), forward only, on every rank."""
        runner = self._runner(model, loss_fn)
        self._in_schedule = True
        try:
            return runner.evaluate(*_inputs_and_targets(self.parallelized.inner, batch))
        finally:
            self._in_schedule = False

    def _runner(self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor] | None) -> Any:
        runner = self.parallelized.pipeline
        if runner is None:
            raise RuntimeError("this layout has no pipeline (pp=1): call the model, compute the loss and "
                               "fabric.backward(loss)")
        if _unwrapped(model) not in (self.parallelized.module, self.parallelized.inner):
            raise ValueError("pipeline_step takes the model fabric.setup returned")
        if loss_fn is not None:
            runner.loss_fn = loss_fn
        if runner.loss_fn is None:
            raise ValueError(f"pipeline parallel computes the loss on the last stage: pass loss_fn(logits, targets) "
                             f"or define loss_fn on {type(self.parallelized.inner).__name__}")
        return runner

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: lightning_par clips by the 2-norm of the whole gradient "
                             "(every shard, stage and partition); use norm_type=2")
        self.precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        norm = self.parallelized.clip_grad_norm_(parameters, float(max_norm))
        if error_if_nonfinite and not torch.isfinite(torch.tensor(norm)):
            raise RuntimeError(f"the gradient's norm is {norm}: not finite, the gradients were not clipped")
        return torch.tensor(norm)

    # ------------------------------------------------------------------------------------------ collectives
    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None,
                   reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Wait for every rank, and for an asynchronous save still being written to be in place."""
        self.trainer_strategy._finish_pending_save()
        self.trainer_strategy.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return self.trainer_strategy.broadcast(obj, src)

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, nn.Module | Optimizer | Any],
                        storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Write ``state`` as the Trainer's strategies do (``lightning_par/checkpoint/format.py``): sharded and
        reshardable (or one full file with ``save_distributed_checkpoint=False``), written atomically, in the
        background with ``async_save=True`` (the next save or load, and teardown, wait for it). The model
        set up goes where the Trainer keeps the LightningModule's weights, the optimizers where it keeps its
        optimizers'; every other entry is kept as it is (its ``state_dict()`` where it has one)."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter: a "
                            "checkpoint holds the whole model, so that it loads under any layout")
        inner, full = self.parallelized.inner, not self.trainer_strategy._save_distributed_checkpoint
        model_key, optimizers, checkpoint = self._parts(state)
        checkpoint = {key: value.state_dict() if isinstance(value, _Stateful) else value
                      for key, value in checkpoint.items()}
        checkpoint[ckpt.MODEL_KEY] = ckpt.model_state_dict(inner, full=full, aliases=False)
        checkpoint[ckpt.OPTIMIZERS_KEY] = [ckpt.optimizer_state_dict(inner, o, full=full) for _, o in optimizers]
        checkpoint[ckpt.TIED_KEY] = tied_aliases(inner)
        checkpoint[ckpt.FABRIC_KEY] = {"model": model_key, "optimizers": [key for key, _ in optimizers]}
        path = location(self.broadcast(str(path)))
        self.trainer_strategy._finish_pending_save()
        self.trainer_strategy._enter(f"saving checkpoint {path}")
        self.trainer_strategy._write_checkpoint(checkpoint, path)
        self.trainer_strategy._enter(f"after saving {path}")

    @override
    def load_checkpoint(self, path: _PATH, state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any]
                        | None = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of this strategy or of a Trainer's (either format, any layout) into ``state``: the model
        set up, its optimizers (in the order they were saved) and any other entry named; returns what is left."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}.load_checkpoint takes the state to restore, with the model set up "
                             "in it: fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        path = location(self.broadcast(str(path)))
        self.trainer_strategy._finish_pending_save()
        self.trainer_strategy._enter(f"loading checkpoint {path}")
        _, optimizers, requested = self._parts(state)
        rest = ckpt.load_checkpoint(path, self.parallelized.inner, [o for _, o in optimizers], strict=strict,
                                    weights_only=self.trainer_strategy._checkpoint_weights_only if weights_only is None
                                    else weights_only)
        for key in (ckpt.FABRIC_KEY, ckpt.TIED_KEY, ckpt.MODEL_KEY):
            rest.pop(key, None)
        _validate_keys_for_strict_loading(requested, rest, strict=strict)
        for key, value in requested.items():
            if key not in rest:
                continue
            if isinstance(value, _Stateful):
                value.load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    def _parts(self, state: dict[str, Any]) -> tuple[str, list[tuple[str, Optimizer]], dict[str, Any]]:
        """(the key of the model set up, the optimizers by key, the other entries) of ``state``."""
        laid_out = (self.parallelized.module, self.parallelized.inner)  # as set up, or without its DDP wrapper
        model_keys = [key for key, value in state.items()
                      if isinstance(value, nn.Module) and any(_unwrapped(value) is m for m in laid_out)]
        if len(model_keys) != 1:
            raise ValueError(f"the state must hold the model fabric.setup returned, once (it holds it under "
                             f"{model_keys or 'no key'}): {{'model': model, 'optimizer': optimizer, ...}}")
        optimizers = [(key, value) for key, value in state.items() if isinstance(value, Optimizer)]
        others = {key: value for key, value in state.items() if key not in model_keys
                  and not isinstance(value, Optimizer)}
        return model_keys[0], optimizers, others


class _NoSyncThroughTheHandle(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the handle's ``no_sync`` (DDP's, ZeRO's, or the reduction after backward)."""

    def __init__(self, strategy: MeshFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._strategy.parallelized.no_sync() if enabled else nullcontext()


class _RegisteredAs:
    """A registry that takes what a Trainer strategy registers and registers ``strategy`` in its place."""

    def __init__(self, strategy: type[MeshFabricStrategy], registry: Any) -> None:
        self._strategy, self._registry = strategy, registry

    def register(self, name: str, strategy: Any = None, description: str | None = None, override: bool = False,
                 **init_params: Any) -> None:
        self._registry.register(name, self._strategy, description=description, override=override, **init_params)


def _unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without Fabric's wrapper (``fabric.setup`` returns one)."""
    return getattr(module, "_forward_module", module)


def _on_parameters(optimizer: Optimizer, names: dict[Tensor, str], now: dict[str, Tensor]) -> Optimizer:
    """``optimizer`` stepping the parameters of ``now`` in place of those it was built on (``names``: their names);
    a parameter this rank no longer holds (another pipeline stage's) leaves its group."""
    if optimizer.state:
        raise ValueError("the optimizer has stepped already: set it up with the model (fabric.setup(model, "
                         "optimizer)) before its first step")
    for group in optimizer.param_groups:
        group["params"] = [now[names[p]] for p in group["params"] if p in names and names[p] in now]
    return optimizer


def _inputs_and_targets(module: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
    split = getattr(module, "split_batch", None)
    if callable(split):
        return split(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"pipeline_step reads a batch as (inputs, targets), or through {type(module).__name__}"
                     f".split_batch(batch); got a {type(batch).__name__}")


def _fabric_counterpart(trainer_strategy: type[MeshStrategy]) -> type[MeshFabricStrategy]:
    """The Fabric strategy of ``trainer_strategy``: the same name, arguments and layout."""
    doc = (f"``{trainer_strategy.strategy_name}`` under Lightning Fabric: the arguments of the Trainer's "
           f":class:`lightning_par.strategies.{trainer_strategy.__name__}`, laid out alike (docs/fabric.md).")
    return type(trainer_strategy.__name__, (MeshFabricStrategy,),
                {"trainer_strategy_class": trainer_strategy, "__doc__": doc, "__module__": __name__})


DataParallelStrategy = _fabric_counterpart(data_parallel.DataParallelStrategy)
ZeroStrategy = _fabric_counterpart(zero.ZeroStrategy)
TensorParallelStrategy = _fabric_counterpart(tensor_parallel.TensorParallelStrategy)
ContextParallelStrategy = _fabric_counterpart(context_parallel.ContextParallelStrategy)
PipelineParallelStrategy = _fabric_counterpart(pipeline_parallel.PipelineParallelStrategy)
ExpertParallelStrategy = _fabric_counterpart(expert_parallel.ExpertParallelStrategy)
Hybrid3DStrategy = _fabric_counterpart(hybrid3d.Hybrid3DStrategy)
AutoParallelStrategy = _fabric_counterpart(hybrid3d.AutoParallelStrategy)
FABRIC_STRATEGIES = (DataParallelStrategy, ZeroStrategy, TensorParallelStrategy, ContextParallelStrategy,
                     PipelineParallelStrategy, ExpertParallelStrategy, Hybrid3DStrategy, AutoParallelStrategy)


def register_fabric_strategies() -> None:
    """Add every lightning_par strategy name to Fabric's registry (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for strategy in FABRIC_STRATEGIES:
        strategy.register_strategies(STRATEGY_REGISTRY)


register_fabric_strategies()

__all__ = ["MeshFabricStrategy", "FABRIC_STRATEGIES", "register_fabric_strategies", "DataParallelStrategy",
           "ZeroStrategy", "TensorParallelStrategy", "ContextParallelStrategy", "PipelineParallelStrategy",
           "ExpertParallelStrategy", "Hybrid3DStrategy", "AutoParallelStrategy"]
