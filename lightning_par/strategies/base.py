"""MeshStrategy: the Lightning shell every lightning_par strategy shares.

One :class:`~lightning_par.layout.config.ParallelConfig`, one named device mesh, one call into
:func:`lightning_par.parallel.compose.parallelize`, whose handle (``Parallelized``) the strategy asks at every step:
the module to run, the pipeline runner, gradient sync, the optimizer's sharding, the gradient norm's groups, the
loss context. Subclasses translate their constructor arguments into a ``ParallelConfig`` (``Hybrid3DStrategy`` also
plans the sizes left ``"auto"``, in ``_choose_layout``). The layers below hold the rest: ``strategies/steps.py``
(each step through the handle), ``strategies/checkpointing.py`` (sharded and full checkpoints, resume) and
``strategies/processes.py`` (process start-up, fault monitor, collectives).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.health.bad_steps import BadSteps
from lightning_par.layout.config import Float8Recipe, ParallelConfig, Recompute
from lightning_par.parallel.compose import parallelize
from lightning_par.parallel.initialize import initialize_meta_model
from lightning_par.parallel.model_call import ModelCall, calling_as
from lightning_par.parallel.mesh import build_mesh
from lightning_par.parallel.parallelized import Parallelized, parallelized_by_its_author
from lightning_par.parallel.model_map import ModelMap, resolve_model_map
from lightning_par.strategies.full_batches import drop_partial_last_batch
from lightning_par.strategies.setup_checks import check_module, sample_for_layout
from lightning_par.strategies.steps import StepsThroughTheHandle
from lightning_par.strategies.resilience import share_rng_states
from lightning_par.strategies.unit_controls import resolve_units, split_auto

# Lightning 2.6 asks torch 2.13's pytree with a check torch has deprecated, at every step of every run: nothing a
# user could act on (Lightning's own code), so not said.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                        module=r"lightning\.pytorch\.utilities\._pytree")


class MeshStrategy(StepsThroughTheHandle):
    """Base of every lightning_par strategy: one ``ParallelConfig``, one mesh, one ``parallelize`` call.

    Args:
        parallel_config: sizes of every mesh dimension and technique knobs.
        activation_checkpointing: ``none``, ``full``, ``selective`` or per-op (``op``) recomputation per block (Chen
            et al. 2016; selective: Korthikanti et al. 2022; op: every second matmul output kept,
            ``lightning_par.parallel.recompute``); by default the config's (``none``).
        activation_checkpointing_every: checkpoint one block in this many; by default the config's (1).
        compile: compile every transformer block with ``torch.compile`` after it is sharded (in place: checkpoint
            names do not change); by default the config's (False).
        float8: train the blocks' linear layers in float8 with torchao's ``"tensorwise"`` or ``"rowwise"``
            recipe (``lightning_par.parallel.float8``); by default the config's (None: not at all).
        float8_emulate: compute float8's roundings with high-precision matmuls, for devices without float8
            (by default the config's, False).
        async_tp: overlap sequence parallel's collectives with the matmuls beside them in the compiled blocks
            (torch's micro-pipelined tensor parallel; CUDA only); needs tensor and sequence parallel and compile.
        model_map: where the model keeps its blocks (a :class:`ModelMap` or its dict form from YAML); derived
            from the model when omitted. A LightningModule that defines ``parallelize(mesh, config)``
            parallelizes itself instead (it returns the module to train, or None if it changed itself).
        save_distributed_checkpoint: write sharded DCP directories (reshardable across layouts) instead
            of one full file gathered on rank 0.
        async_save: write sharded checkpoints in the background while training goes on
            (``torch.distributed.checkpoint.async_save``; Lightning's ``AsyncCheckpointIO`` plugin asks the same).
            Training stops only to copy the tensors to CPU memory; docs/checkpoints.md, "Asynchronous saves".
        checkpoint_weights_only: load checkpoints with ``torch.load(weights_only=True)``: tensors, containers,
            builtins and NumPy RNG states only, nothing whose unpickling could run code. ``False`` trusts the
            checkpoint's source (``trainer.fit(..., weights_only=False)`` does not reach strategies that restore
            after set-up in Lightning 2.6, so the opt-in is here).
        process_group_backend: ``"nccl"`` / ``"gloo"``; by default from the device type.
        timeout: how long a collective may wait before the process group raises; also the bound within which
            every rank exits after one rank dies or hangs (see ``lightning_par/health/fault_monitor.py``).
        bad_steps: which steps are skipped before the optimizer applies them, alike on every rank, and how many in
            a row stop the run (:class:`~lightning_par.health.bad_steps.BadSteps` or its fields as a dict; by default a
            step with a non-finite loss or gradient is skipped, and 3 in a row stop the run). See
            ``lightning_par/health/bad_steps.py``.
    """

    strategy_name = "mesh"
    strategy_description = "lightning_par strategy"
    #: ZeRO-3's gather controls given "auto", chosen at set-up (:meth:`_unit_controls`).
    _auto_units: set[str] = set()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy_name`` (subclasses with several names override this)."""
        strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description, override=True)

    def __init__(self, parallel_config: ParallelConfig | None = None, *,
                 activation_checkpointing: Recompute | None = None, activation_checkpointing_every: int | None = None,
                 compile: bool | None = None, float8: Float8Recipe | None = None,
                 float8_emulate: bool | None = None, async_tp: bool | None = None,
                 model_map: ModelMap | dict[str, Any] | None = None,
                 save_distributed_checkpoint: bool = True, async_save: bool = False,
                 checkpoint_weights_only: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 bad_steps: BadSteps | dict[str, Any] | None = None, **lightning_arguments: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, async_save=async_save,
                         checkpoint_weights_only=checkpoint_weights_only, process_group_backend=process_group_backend,
                         timeout=timeout, bad_steps=bad_steps, **lightning_arguments)
        config = parallel_config if parallel_config is not None else ParallelConfig()
        given = {"activation_checkpointing": activation_checkpointing,
                 "activation_checkpointing_every": activation_checkpointing_every, "compile": compile,
                 "float8": float8, "float8_emulate": float8_emulate, "async_tp": async_tp}
        self.parallel_config = dataclasses.replace(config, **{k: v for k, v in given.items() if v is not None})
        # Refuse what cannot work before any process group exists, so every rank fails alike. The messages name the
        # config's fields as its maker did: a subclass's arguments, or the fields of a ParallelConfig given here.
        self.parallel_config.validate()
        self.parallel_config.check_composable()
        if self.parallel_config.pp > 1 and not save_distributed_checkpoint:
            raise ValueError(f"{self.parallel_config.named('pp')}: each rank saves its own stages, so checkpoints are "
                             "sharded; save_distributed_checkpoint=False is not supported - export a single file "
                             "with lightning-par-export instead")
        self._model_map = ModelMap.from_dict(model_map) if isinstance(model_map, dict) else model_map
        self._parallelized: Parallelized | None = None

    def _unit_controls(self, **given: Any) -> dict[str, Any]:
        """ZeRO-3's gather controls for the configuration: each given ``"auto"`` stands as its default until
        set-up chooses it from the model (``lightning_par.strategies.unit_controls``)."""
        values, self._auto_units = split_auto(given)
        return values

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.start_processes_and_mesh()
        if self.lightning_module is not None:
            # LightningModule.device_mesh, for user code in configure_model()/parallelize()
            self.lightning_module._device_mesh = self._mesh.root

    def start_processes_and_mesh(self) -> None:
        """Choose and check the layout, connect the ranks and build the mesh: the process side of
        ``setup_environment``, which the Fabric strategies (``strategies/fabric.py``) run on the strategy they hold."""
        self._prepare_process()
        # Validate the sizes before the first collective: every rank raises the same ValueError.
        self.parallel_config = self._choose_layout(self.parallel_config).validate(self.world_size)
        self._check_checkpoint_format()
        self._start_process_group()
        self._mesh = build_mesh(self.parallel_config, self.root_device.type)
        rank_zero_info(f"{type(self).__name__}: {self.world_size} processes as {self.parallel_config.describe()}, "
                       f"zero_stage={self.parallel_config.zero_stage}")
        # Tensor- then context-parallel ranks share rank (cp 0, tp 0)'s states: the ranks of one stage of one replica
        # hold the same activations wherever the layout does not split them (lightning_par/parallel/rng.py).
        for name in ("tp", "cp"):
            if self._mesh.size(name) > 1:
                share_rng_states(self._mesh.group(name), self.root_device)

    def _choose_layout(self, config: ParallelConfig) -> ParallelConfig:
        """The layout to run: the configured one (strategies that plan sizes override this). Runs on every
        rank before any process group exists, so it must decide the same everywhere."""
        return config

    # ----------------------------------------------------------------------------- model
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        check_module(self.lightning_module, self.parallel_config, trainer, fitting=fitting)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelized = self._parallelize(self.model, trainer, training=fitting)
        self.model = self.parallelized.module
        if self.parallel_config.pp > 1:
            # Lightning's model summary runs example_input_array through the whole model, of which a pipeline stage
            # holds a part: it lists the layers without their input and output sizes. Put back at teardown.
            self._example_input, self.lightning_module.example_input_array = (
                self.lightning_module.example_input_array, None)
        if fitting:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: nn.Module, trainer: Trainer, *, training: bool) -> Parallelized:
        owner = self.lightning_module
        return self.lay_out(module, owner, training=training, accumulate=trainer.accumulate_grad_batches,
                            sample=lambda config, model_map: sample_for_layout(owner, config, model_map,
                                                                               self.broadcast, self.root_device))

    def lay_out(self, module: nn.Module, owner: nn.Module, *, training: bool, accumulate: int,
                sample: Callable[[ParallelConfig, ModelMap | None], tuple[Tensor, Tensor | None] | ModelCall | None],
                **parallelize_options: Any) -> Parallelized:
        """Lay ``module`` out on the mesh: as ``owner`` (the LightningModule, or Fabric's module) parallelizes
        itself, as its author already did, or through ``parallelize`` with the model map, ``owner``'s model contract
        (``loss_fn``, ``loss_tokens``) and ``sample(config, model_map)``: one batch of the data, how the step calls the
        model on it (the set-up's runs of the model then call it so: ``parallel/model_call.py``), or None.
        ``parallelize_options`` go to ``parallelize`` (``dry_run``)."""
        config, mesh = self.parallel_config, self.mesh
        # A model built on the meta device: allocated and initialised as one process would draw it (a dry run's
        # allocation makes fake tensors instead).
        allocate = parallelize_options.get("dry_run") or initialize_meta_model
        hook: Callable[..., nn.Module | None] | None = getattr(owner, "parallelize", None)
        if callable(hook):
            returned = hook(mesh, config)
            module = module if returned is None else returned
            allocate(module, self.root_device)
            return Parallelized(module, mesh, config,
                                reduces_after_backward=training and config.reduces_gradients_after_backward)
        if parallelized_by_its_author(module):
            # Lightning's ModelParallelStrategy idiom: configure_model() split and sharded the model itself on
            # self.device_mesh["tensor_parallel"] / ["data_parallel"]. It is trained as it is.
            rank_zero_info(f"{type(self).__name__}: the model parallelized itself; the strategy applies no model "
                           "map to it")
            allocate(module, self.root_device)
            return Parallelized.as_given(module, mesh, config)
        model_map = resolve_model_map(self._model_map, module)
        self.parallel_config = config = resolve_units(config, self._auto_units, module, model_map,
                                                      self.root_device, self.num_processes,
                                                      log=lambda line: rank_zero_info(f"{type(self).__name__}: {line}"))
        taken = sample(config, model_map)
        call = taken if isinstance(taken, ModelCall) else None
        with calling_as(call):
            return parallelize(module, mesh, config, model_map, training=training, device=self.root_device,
                               device_ids=None if self.root_device.type == "cpu" else [self.root_device.index],
                               sample_batch=(call.sample, None) if call is not None else taken, log=rank_zero_info,
                               loss_fn=getattr(owner, "loss_fn", None), accumulate=accumulate,
                               loss_tokens=getattr(owner, "loss_tokens", None), **parallelize_options)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # A pipeline trains on full batches only; its evaluation pads a short batch (PipelineRunner.forward).
        if self.parallel_config.pp > 1 and self.lightning_module.trainer.training:
            return drop_partial_last_batch(dataloader, rank_zero_info)
        return dataloader

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        sharded = [self.parallelized.shard_optimizer(o) for o in self.optimizers]
        for config in self.lr_scheduler_configs:
            # Schedulers hold the optimizer they were built with; point them at its sharded replacement.
            for original, replacement in zip(self.optimizers, sharded):
                if config.scheduler.optimizer is original:
                    point_scheduler_at(config.scheduler, replacement)
        self.optimizers = sharded

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips through the precision plugin with torch's clip_grad_norm_, which sees only this
        # rank's pieces of a sharded gradient. Clip by the norm of the whole gradient instead.
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.parallelized.clip_grad_norm_(
            _parameters(optimizer), float(clip_val))

    def gradient_norm(self, optimizer: Optimizer) -> float:
        """The 2-norm of the whole model's gradient (every shard, stage and partition), on every rank. Collective."""
        return self.parallelized.gradient_norm(_parameters(optimizer))

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `Trainer.init_module(empty_init=True)`: build on the meta device; parallelize() allocates the
        # parameters later, after sharding under ZeRO-3, so no rank ever holds the whole model.
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if any(p.is_meta for p in self.model.parameters()):
            return  # allocated on the device by parallelize()
        self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        if getattr(self, "_example_input", None) is not None and self.lightning_module is not None:
            self.lightning_module.example_input_array, self._example_input = self._example_input, None
        if self._parallelized is not None:
            self.model = self._parallelized.inner  # drop the DDP wrapper; the next run wraps again
            if self.parallel_config.compile:
                # Lightning's teardown moves the module to the CPU, which swaps DTensor parameters for new ones; the
                # guards of a compiled block that breaks its graph (an MoE layer's routing runs eagerly) hold weak
                # references to them, which forbid the swap. Dropping the compiled code lets the move happen (a later
                # fit, validate or test compiles again).
                torch._dynamo.reset()
        if self.root_device.type == "cpu" and self.lightning_module is not None:
            # Already there: no move, so nothing a compiled block still refers to is swapped (recomputed blocks
            # compiled keep fake copies of their parameters' metadata alive, which forbids it too).
            with _kept_in_place(self.lightning_module):
                super().teardown()
            return
        super().teardown()


@contextmanager
def _kept_in_place(module: nn.Module) -> Generator[None, None, None]:
    """``module.cpu()`` does nothing inside."""
    module.cpu = lambda: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu


def point_scheduler_at(scheduler: Any, optimizer: Optimizer) -> None:
    """Make ``scheduler`` (built on another optimizer) schedule ``optimizer``, its replacement by the layout (a
    ZeroRedundancyOptimizer, an optimizer over the new parameters). torch's ``LRScheduler`` marks the ``step`` of the
    optimizer it was built with, and warns at its first step that ``optimizer.step()`` "has been overridden" when
    the step it finds is unmarked: the replacement's step is marked the same way, so a correct run says nothing."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def counted_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # what the scheduler reads to say it was stepped before the optimizer
        return step(*args, **kwargs)

    counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted_step  # type: ignore[method-assign]


def _parameters(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
