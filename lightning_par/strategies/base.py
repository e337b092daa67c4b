"""MeshStrategy: the Lightning shell every lightning_par strategy shares.

It owns process-group set-up, the one named device mesh, resolving the model's plan, the single call
into :func:`lightning_par.parallel.compose.parallelize`, optimizer set-up, collectives on the right
groups, data sharding by data-parallel rank, and sharded checkpoints. Subclasses only translate their
constructor arguments into a :class:`~lightning_par.config.ParallelConfig`.

Launchers and cluster environments are Lightning's own, unchanged: a plain script (Lightning starts
the other processes), SLURM, torchelastic/torchrun.
"""

from __future__ import annotations

import atexit
import os
import re
from collections.abc import Generator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _set_rng_states, reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par import checkpoint as ckpt
from lightning_par.config import ParallelConfig
from lightning_par.fault import FLIGHT_RECORDER_ENTRIES, FaultMonitor, heartbeat_interval, stop_processes
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.clip import clip_grad_norm_, gradient_norm
from lightning_par.parallel.compose import (
    applied_layout,
    check_batch_fits,
    gradient_norm_groups,
    no_gradient_sync,
    parallelize,
    parallelize_optimizer,
    pipeline_stages,
    stage_ties,
)
from lightning_par.parallel.comm import PipelineSends
from lightning_par.parallel.data import broadcast_replicas, reduce_gradients, unwrap
from lightning_par.parallel.pipeline import check_microbatches
from lightning_par.parallel.pipeline_runner import PipelineRunner
from lightning_par.parallel.plan import ModelPlan, derive_plan, huggingface_plan
from lightning_par.parallel.tensor import vocab_parallel_loss
from lightning_par.parallel.ties import tied_aliases
from lightning_par.strategies.resilience import (
    RNG_STATES_KEY,
    RequeueOnPreemption,
    gather_rng_states,
    init_process_group_under_torchelastic,
    rng_states_of_rank,
    share_rng_states,
    slurm_requeue_environment,
)

# The arguments every strategy that has them spells alike (ParallelConfig field -> argument).
SIZE_ARGUMENTS = {"dp": "data_parallel_size", "tp": "tensor_parallel_size", "pp": "pipeline_parallel_size",
                  "cp": "context_parallel_size", "ep": "expert_parallel_size"}
DDP_ARGUMENTS = {"ddp_bucket_cap_mb": "bucket_cap_mb", "ddp_static_graph": "static_graph",
                 "ddp_find_unused_parameters": "find_unused_parameters"}

# Set when a run raised: the exit handler then leaves the process group alone instead of waiting for peers.
_RUN_FAILED = False


def _destroy_process_group_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole.

    Left to interpreter finalization, gloo's worker threads can still hold work objects whose tensors need
    the GIL, and the process aborts ("terminate called without an active exception") after a run that
    succeeded (seen with torch 2.13 on CPU; pytorch/pytorch#190489). A bounded barrier first, so no rank
    tears down connections a peer is still using.
    """
    if _RUN_FAILED or not torch.distributed.is_initialized():
        return
    try:
        if torch.distributed.get_backend() == "gloo":
            torch.distributed.monitored_barrier(timeout=timedelta(seconds=60))
        else:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; a failed clean-up must not mask the run's result
        pass


_STOPPING_LAUNCHED_RANKS = False  # the exit handler below is registered


def _stop_launched_ranks_at_failed_exit(processes: list[Any], grace: float) -> None:
    """When this process, which started the other ranks (Lightning's subprocess launcher), exits after a failed run:
    wait up to ``grace`` for them to leave and kill what is left, so that the launching command returns only once
    no rank of the run is running. (Lightning reaps them only when a child fails.) At exit rather than at teardown,
    so that a script that catches the error and goes on keeps its ranks."""
    global _STOPPING_LAUNCHED_RANKS
    if _STOPPING_LAUNCHED_RANKS:
        return
    _STOPPING_LAUNCHED_RANKS = True

    def stop() -> None:
        if _RUN_FAILED:
            stop_processes(processes, grace=grace)

    atexit.register(stop)

# Metrics logged with sync_dist are averaged over the ranks that saw different data. Ranks in the same
# tensor/pipeline group hold the same value, so including them would only cost bandwidth.
METRIC_GROUP = "dp_cp"


class MeshStrategy(ParallelStrategy):
    """Base of every lightning_par strategy: one ``ParallelConfig``, one mesh, one ``parallelize`` call.

    Args:
        parallel_config: sizes of every mesh dimension and technique knobs.
        plan: where the model keeps its blocks (a :class:`ModelPlan` or its dict form from YAML); derived
            from the model when omitted. A LightningModule that defines ``parallelize(mesh, config)``
            parallelizes itself instead (it returns the module to train, or None if it changed itself).
        save_distributed_checkpoint: write sharded DCP directories (reshardable across layouts) instead
            of one full file gathered on rank 0. With Lightning's ``AsyncCheckpointIO`` plugin
            (``Trainer(plugins=[AsyncCheckpointIO()])``) they are written in the background while training
            goes on (``torch.distributed.checkpoint.async_save``).
        checkpoint_weights_only: load checkpoints with ``torch.load(weights_only=True)``: tensors, containers,
            builtins and NumPy RNG states only, nothing whose unpickling could run code. ``False`` trusts the
            checkpoint's source (``trainer.fit(..., weights_only=False)`` does not reach strategies that restore
            after set-up in Lightning 2.6, so the opt-in is here).
        process_group_backend: ``"nccl"`` / ``"gloo"``; by default from the device type.
        timeout: how long a collective may wait before the process group raises; also the bound within which
            every rank exits after one rank dies or hangs (see ``lightning_par/fault.py``).
    """

    strategy_name = "mesh"
    strategy_description = "lightning_par strategy"
    #: ParallelConfig field -> the argument of this strategy that sets it, so that errors speak the user's terms
    #: (none here: a MeshStrategy is given the ParallelConfig itself).
    argument_names: dict[str, str] = {}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy_name`` (subclasses with several names override this)."""
        strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description, override=True)

    def __init__(
        self,
        parallel_config: ParallelConfig | None = None,
        *,
        plan: ModelPlan | dict[str, Any] | None = None,
        save_distributed_checkpoint: bool = True,
        checkpoint_weights_only: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.parallel_config = parallel_config if parallel_config is not None else ParallelConfig()
        # Refuse what cannot work before any process group exists, so every rank fails alike.
        with self.in_argument_names():
            self.parallel_config.check()
            self.parallel_config.check_composable()
        self._plan = ModelPlan.from_dict(plan) if isinstance(plan, dict) else plan
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._checkpoint_weights_only = checkpoint_weights_only
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._mesh: ParallelMesh | None = None
        self._num_nodes = 1
        self._gradient_sync_blocked = False  # inside block_backward_sync (gradient accumulation)
        self._fault_monitor: FaultMonitor | None = None
        self._rng_states_to_restore: dict[str, Any] | None = None  # put back at the first batch after a resume
        self._pending_save: Future | None = None  # an asynchronous save still being written
        self._checkpoint_group: torch.distributed.ProcessGroup | None = None
        self._failed_with: BaseException | None = None  # the exception this run raised, until teardown
        self._applied_in_configure_model: bool | None = None  # DTensors or FSDP2 before the strategy's set-up
        self._average_gradients = False  # reduce gradients over dp after backward (a self-parallelized module)
        self._pipeline: PipelineRunner | None = None  # pp > 1: runs the stages in every step method
        if self.parallel_config.pp > 1 and not save_distributed_checkpoint:
            with self.in_argument_names():
                raise ValueError(f"pp={self.parallel_config.pp}: each rank saves its own stages, so checkpoints are "
                                 "sharded; save_distributed_checkpoint=False is not supported - export a single file "
                                 "with lightning-par-export instead")

    @contextmanager
    def in_argument_names(self) -> Generator[None, None, None]:
        """Re-raise a ``ValueError`` about the layout in the names of this strategy's arguments
        (``data_parallel_size=-1``, not the mesh dimension ``dp_replicate=-1`` it became). A run's errors are
        renamed in :meth:`on_exception`; this is for what is checked before the run (the constructor)."""
        try:
            yield
        except ValueError as error:
            self._rename_arguments(error)
            raise

    def _rename_arguments(self, error: BaseException) -> None:
        names = self.argument_names
        if names and isinstance(error, ValueError) and error.args and isinstance(error.args[0], str):
            pattern = r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b"
            error.args = (re.sub(pattern, lambda match: names[match.group(1)], error.args[0]), *error.args[1:])

    # --------------------------------------------------------------------------- topology
    @property
    def mesh(self) -> ParallelMesh:
        """The named device mesh (available from ``setup_environment`` on)."""
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.mesh is built when the processes start (setup_environment)")
        return self._mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning injects its DistributedSampler only for strategies that say so.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard by data-parallel rank: ranks of one tensor/context/pipeline group must read the same sample.
        return {"num_replicas": self.mesh.size("dp"), "rank": self.mesh.local_rank("dp")}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ------------------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does: processes sharing a machine's cores get a share each. With every process using
            # every core, configs/hybrid3d.yaml (8 ranks on 2 cores) took 79 s for 6 steps instead of 42 s.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        reset_seed()
        self.set_world_ranks()
        # Validate the sizes before the first collective: every rank raises the same ValueError.
        self.parallel_config = self._choose_layout(self.parallel_config).validate(self.world_size)
        if self._saves_asynchronously and not self._save_distributed_checkpoint:
            raise ValueError("AsyncCheckpointIO writes through torch.distributed.checkpoint.async_save, which needs "
                             "the sharded format: set save_distributed_checkpoint=True or drop the plugin")
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        # The flight recorder names the collective that failed (read when the process group starts).
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        timeout = self._timeout or default_pg_timeout
        if isinstance(self._launcher, _SubprocessScriptLauncher) and self._launcher.procs:
            # Once a failure is reported the others leave within their monitors' grace (3 heartbeats), a heartbeat
            # later at most; what is left then is killed.
            _stop_launched_ranks_at_failed_exit(self._launcher.procs, 5 * heartbeat_interval(timeout.total_seconds()))
        if not torch.distributed.is_initialized():
            if not init_process_group_under_torchelastic(self.cluster_environment, self._process_group_backend,
                                                         timeout, device_id):
                _init_dist_connection(
                    self.cluster_environment, self._process_group_backend, timeout=timeout, device_id=device_id
                )
            atexit.register(_destroy_process_group_at_exit)
        self._mesh = self.parallel_config.build_mesh(self.root_device.type)
        if self._mesh.size("tp") > 1:
            share_rng_states(self._mesh.group("tp"), self.root_device)
        if self.world_size > 1 and self._fault_monitor is None:
            store = torch.distributed.distributed_c10d._get_default_store()
            self._fault_monitor = FaultMonitor(store, self.global_rank, self.world_size,
                                               timeout=timeout.total_seconds())
            self._fault_monitor.start()
        if self.lightning_module is not None:
            # LightningModule.device_mesh, for user code in configure_model()/parallelize()
            self.lightning_module._device_mesh = self._mesh.root

    def _choose_layout(self, config: ParallelConfig) -> ParallelConfig:
        """The layout to run: the configured one (strategies that plan sizes override this). Runs on every
        rank before any process group exists, so it must decide the same everywhere."""
        return config

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----------------------------------------------------------------------------- model
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        config = self.parallel_config
        if config.pp > 1:
            for name in ("split_batch", "loss_fn"):
                if not callable(getattr(self.lightning_module, name, None)):
                    raise TypeError(f"pipeline parallel needs the LightningModule to define {name}(); the schedule "
                                    "runs split_batch -> forward -> loss_fn itself (see docs/pipeline_parallel.md)")
            check_microbatches(config.pp_microbatches, config.pp_schedule, config.pp)
        if fitting and not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"{type(self.lightning_module).__name__} has no trainable parameters (it has none, or "
                             "every one has requires_grad=False): there is nothing to train. Unfreeze some, or add "
                             "them in configure_model()")
        if fitting and self.parallel_config.ddp_static_graph and trainer.accumulate_grad_batches > 1:
            rank_zero_warn(
                "static_graph=True with accumulate_grad_batches > 1: gradients are all-reduced on every "
                "micro-batch, because PyTorch's DDP cannot skip the all-reduce (no_sync) under a static graph"
            )
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._parallelize(self.model, training=fitting)
        if config.pp > 1:
            module = self.lightning_module
            self._pipeline = PipelineRunner(pipeline_stages(module), self.mesh, config, module.loss_fn,
                                            accumulate=trainer.accumulate_grad_batches, device=self.root_device)
        if fitting:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: nn.Module, *, training: bool) -> nn.Module:
        hook: Callable[..., nn.Module | None] | None = getattr(self.lightning_module, "parallelize", None)
        if callable(hook):
            returned = hook(self.mesh, self.parallel_config)
            return module if returned is None else returned
        if self._applied_in_configure_model is None:
            self._applied_in_configure_model = applied_layout(module) is None and _split_or_sharded(module)
        if self._applied_in_configure_model:
            # Lightning's ModelParallelStrategy idiom: configure_model() split and sharded the model itself on
            # self.device_mesh["tensor_parallel"] / ["data_parallel"]. It is trained as it is; only gradients it
            # left unreduced (DTensors without FSDP over data_parallel) are averaged over dp after backward.
            rank_zero_info(f"{type(self).__name__}: the LightningModule parallelized itself in configure_model(); "
                           "the strategy applies no plan to it")
            self._average_gradients = self.mesh.size("dp") > 1 and not any(
                isinstance(m, FSDPModule) for m in module.modules())
            if self._average_gradients:
                broadcast_replicas(module, self.mesh)
            return module
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
        plan = self.resolve_plan(module)
        config = self.parallel_config
        # Checking a tensor-parallel plan and cutting pipeline stages run the model on a sample of the data; with
        # it, what the layout needs of every batch is checked before the first step.
        sample = self._sample_batch() if config.tp > 1 or config.pp > 1 or config.cp > 1 else None
        if sample is not None:
            inputs = sample[0]
            batch_size = getattr(_data_of_this_run(self.lightning_module.trainer), "batch_size", None)
            check_batch_fits(config, batch_size=batch_size if isinstance(batch_size, int) else inputs.shape[0],
                             seq_len=inputs.shape[1] if inputs.dim() == 2 else None)
        if config.tp > 1 and plan is not None and sample is None:
            raise ValueError(f"tp={config.tp}: the tensor-parallel plan is checked on one sample of the "
                             "data before training, and none could be taken: define split_batch(batch) -> (inputs, "
                             "targets) on the LightningModule, or use batches of token tensors, of (inputs, ...) "
                             "tuples or of dicts with 'input_ids' (see docs/models.md)")
        return parallelize(module, self.mesh, config, plan, training=training, device=self.root_device,
                           device_ids=device_ids, sample_batch=sample, log=rank_zero_info)

    def _sample_batch(self) -> tuple[Tensor, Tensor | None] | None:
        """The first batch of the data this run reads, as the model contract's (inputs, targets): through
        ``split_batch`` when the module defines it, else a batch of token ids, a dict's ``input_ids`` or a tuple's
        first tensor as the inputs. None without data. Techniques that check, trace or time the model at set-up
        run it on this."""
        module = self.lightning_module
        loader = _data_of_this_run(module.trainer)
        if loader is None:
            return None
        # Rank 0's: a shuffling loader would hand each rank another first batch, and ranks that check or cut the
        # model together must run it on the same sample.
        batch = self.broadcast(next(iter(loader)))
        split = getattr(module, "split_batch", None)
        if callable(split):
            inputs, targets = split(batch)
            if self.parallel_config.pp > 1:  # one micro-batch: what a stage runs at a time
                size = max(1, inputs.shape[0] // self.parallel_config.pp_microbatches)
                inputs, targets = inputs[:size], targets[:size]
            return inputs, targets
        if isinstance(batch, Tensor):
            return batch, None
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
            return batch["input_ids"], None
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):  # (inputs, targets, ...)
            return batch[0], None
        return None

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        sharded = [parallelize_optimizer(o, self.model, self.mesh, self.parallel_config) for o in self.optimizers]
        for config in self.lr_scheduler_configs:
            # Schedulers hold the optimizer they were built with; point them at its sharded replacement.
            for original, replacement in zip(self.optimizers, sharded):
                if config.scheduler.optimizer is original:
                    config.scheduler.optimizer = replacement
        self.optimizers = sharded

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips through the precision plugin with torch's clip_grad_norm_, which sees only this
        # rank's pieces of a sharded gradient. Clip by the norm of the whole gradient instead.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(parameters, float(clip_val), counted=self._counted_once(parameters),
                        **gradient_norm_groups(self.mesh, self.parallel_config))

    def gradient_norm(self, optimizer: Optimizer) -> float:
        """The 2-norm of the whole model's gradient (every shard, stage and partition), on every rank. Collective."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return gradient_norm(self._counted_once(parameters), **gradient_norm_groups(self.mesh, self.parallel_config))

    def _counted_once(self, parameters: list[Tensor]) -> list[Tensor]:
        """``parameters`` without the copies of a tensor that another pipeline rank counts in the norm."""
        ties = stage_ties(self.lightning_module)
        return ties.counted(parameters) if ties is not None else parameters

    def resolve_plan(self, module: nn.Module) -> ModelPlan | None:
        """The plan given to the strategy, else the one a Hugging Face model's config states, else one derived from
        the model (None if it has no standard shape)."""
        if self._plan is not None:
            self._plan.check(module)
            return self._plan
        return huggingface_plan(module) or derive_plan(module)

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

    def _loss_context(self) -> Any:
        # Loss parallel: the model returns vocabulary-sharded logits; the loss and its backward must run
        # where PyTorch knows how to compute cross-entropy on them.
        return vocab_parallel_loss(self.parallel_config.loss_parallel and self.mesh.size("tp") > 1)

    def _enter(self, phase: str) -> None:
        if self._fault_monitor is not None:
            self._fault_monitor.enter(phase)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        environment = slurm_requeue_environment(trainer)
        if environment is not None and not any(isinstance(c, RequeueOnPreemption) for c in trainer.callbacks):
            requeue = RequeueOnPreemption(environment)
            trainer.callbacks.append(requeue)
            requeue.on_train_start(trainer, self.lightning_module)  # the hook has just been called for the others

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._enter(f"training step {self.lightning_module.trainer.global_step}")
        if self._rng_states_to_restore is not None:
            # Taken at the end of the batch before this one: the first draw of this batch continues the saved run.
            _set_rng_states(self._rng_states_to_restore)
            self._rng_states_to_restore = None

    # Under pipeline parallel the runner runs the stages (the model's split_batch -> forward -> loss_fn) and every
    # rank logs the same loss; training_step, validation_step and test_step of the module are not called.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            inputs, targets = self.lightning_module.split_batch(args[0])
            loss = self._pipeline.train_step(inputs, targets, list(self.lightning_module.parameters()))
            self.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=True)
            return loss
        with self._loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._enter("validation")
        if self._pipeline is not None:
            return self._log_evaluation("val_loss", args[0], prog_bar=True)
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._log_evaluation("test_loss", args[0], prog_bar=False)
        with self._loss_context():
            return super().test_step(*args, **kwargs)

    def _log_evaluation(self, name: str, batch: Any, *, prog_bar: bool) -> Tensor:
        assert self._pipeline is not None
        loss = self._pipeline.evaluate(*self.lightning_module.split_batch(batch))
        self.lightning_module.log(name, loss, prog_bar=prog_bar, sync_dist=True)
        return loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:  # the batch is the model's input; every rank gets the last stage's logits
            return self._pipeline.predict(args[0])
        # Predictions leave the strategy whole: vocabulary-sharded logits are gathered.
        return apply_to_collection(super().predict_step(*args, **kwargs), DTensor, DTensor.full_tensor)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:  # the schedule ran backward in training_step: hand its gradients back
            self._pipeline.take_gradients()
            self.post_backward(closure_loss)  # data-parallel gradient average, on the last micro-batch of a step
            return closure_loss
        with self._loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    def bubble_fraction(self) -> float | None:
        """The idle share of this rank's last training step under pipeline parallel (``parallel/bubble.py``)."""
        return self._pipeline.bubble_fraction if self._pipeline is not None else None

    @property
    def pipeline_sends(self) -> PipelineSends | None:
        """Bytes the pipeline stages send, for the communication monitor (None without pipeline parallel)."""
        return self._pipeline.sends if self._pipeline is not None else None

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        self._gradient_sync_blocked = True
        try:
            with no_gradient_sync(self.model):
                yield
        finally:
            self._gradient_sync_blocked = False

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._gradient_sync_blocked:
            return
        # Layouts DDP cannot wrap average their gradients here, after the last backward of a step.
        reduce = (self._average_gradients if self._applied_in_configure_model
                  else self.parallel_config.reduces_gradients_after_backward)
        if reduce:
            reduce_gradients(self.lightning_module, self.mesh)
        ties = stage_ties(self.lightning_module)
        if ties is not None:
            ties.sum_gradients()  # copies of one tensor on several pipeline stages: every copy gets the sum

    @override
    def on_exception(self, exception: BaseException) -> None:
        global _RUN_FAILED
        _RUN_FAILED = True  # peers may be gone or stuck: do not wait for them at exit
        self._failed_with = exception
        self._rename_arguments(exception)  # in the names of this strategy's arguments, not the mesh's
        if self._fault_monitor is not None:
            # Name the rank and the collective; from here this rank exits within the timeout.
            exception.add_note(self._fault_monitor.report(exception))
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self.model is not None and unwrap(self.model) is self.lightning_module:
            self.model = self.lightning_module  # drop the DDP wrapper; the next run wraps again
        failed, self._failed_with = self._failed_with, None
        if failed is None:
            self._finish_pending_save()
        if self._fault_monitor is not None:
            self._fault_monitor.stop()
            self._fault_monitor = None
        if failed is None:
            super().teardown()
            return
        try:
            super().teardown()
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
            # A step that failed half-way can leave modules Lightning's teardown cannot move (FSDP2 between
            # gathering and resharding): that second error would hide the first, which Lightning re-raises.
            failed.add_note(f"(lightning_par: the teardown after this error also failed and was skipped: "
                            f"{type(error).__name__}: {error})")

    # ------------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over ``group``; by default over the data-parallel (x context-parallel) ranks."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._mesh is not None:
            group = self._mesh.group(METRIC_GROUP)
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    # ------------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # States are loaded into the parallelized module and its optimizers, so they must exist first.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint() already restored them

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.model_state_dict(self.lightning_module, full=not self._save_distributed_checkpoint, aliases=False)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return ckpt.optimizer_state_dict(self.lightning_module, optimizer, full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))  # one path for every rank
        self._finish_pending_save()
        self._enter(f"saving checkpoint {path}")
        checkpoint[RNG_STATES_KEY] = gather_rng_states(self.root_device)
        checkpoint[ckpt.TIED_KEY] = tied_aliases(self.lightning_module)
        if self._saves_asynchronously and self._checkpoint_group is None:
            self._checkpoint_group = torch.distributed.new_group(backend="gloo", group_desc="asynchronous checkpoints")
        self._pending_save = ckpt.save_checkpoint(
            checkpoint, path, sharded=self._save_distributed_checkpoint, asynchronous=self._saves_asynchronously,
            process_group=self._checkpoint_group,
        )
        if self._pending_save is None:
            self._note_complete(path)
        else:
            self._pending_save.add_done_callback(lambda done: done.exception() or self._note_complete(path))
        # What runs next (the loop reading the next batch) is no longer the save.
        trainer = self.lightning_module._trainer
        self._enter(f"training after step {trainer.global_step}" if trainer is not None else f"after saving {path}")

    @property
    def _saves_asynchronously(self) -> bool:
        return isinstance(self._checkpoint_io, AsyncCheckpointIO)

    def _note_complete(self, path: Path) -> None:
        if self._fault_monitor is not None:
            self._fault_monitor.last_checkpoint = str(path)

    def _finish_pending_save(self) -> None:
        """Wait for an asynchronous save (raising its error), and for rank 0 to have renamed it into place."""
        if self._pending_save is None:
            return
        pending, self._pending_save = self._pending_save, None
        pending.result()
        self.barrier("checkpoint in place")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        self._finish_pending_save()
        self._enter(f"loading checkpoint {path}")
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        checkpoint = ckpt.load_checkpoint(
            path, self.lightning_module, optimizers, strict=self.lightning_module.strict_loading,
            weights_only=self._checkpoint_weights_only if weights_only is None else weights_only,
        )
        checkpoint.pop(ckpt.TIED_KEY, None)  # load_checkpoint restored the ties already
        self._rng_states_to_restore = rng_states_of_rank(checkpoint.pop(RNG_STATES_KEY, None), self.global_rank,
                                                         self.world_size)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint() loaded the weights in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint() loaded the optimizer states in place

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)

    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """Whole tensors of the model on CPU, on global rank 0 (other ranks get an empty dict). Collective."""
        assert self.lightning_module is not None
        if self.mesh.size("pp") == 1:
            return ckpt.model_state_dict(self.lightning_module, full=True)
        # Each pipeline rank holds different parameters: assemble its stages' whole tensors (tensor-parallel
        # shards gathered), then gather every stage on rank 0.
        mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for k, v in ckpt.model_state_dict(self.lightning_module, full=False).items()}
        if any(index != 0 for name, index in self.mesh.coordinates().items() if name != "pp"):
            return {}  # a replica of what rank 0's pipeline group holds
        parts: list[Any] = [None] * self.mesh.size("pp") if self.global_rank == 0 else None
        torch.distributed.gather_object(mine, parts, dst=0, group=self.mesh.group("pp"))
        return {k: v for part in parts for k, v in part.items()} if self.global_rank == 0 else {}


def _data_of_this_run(trainer: Trainer) -> Any:
    """The dataloader of what ``trainer`` is running (fit: training data), or None when there is none."""
    loop = {TrainerFn.FITTING: trainer.fit_loop, TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop, TrainerFn.PREDICTING: trainer.predict_loop}.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    elif isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    return loader


def _split_or_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters or FSDP2 modules before the strategy parallelized it."""
    return any(isinstance(p, DTensor) for p in module.parameters()) or any(
        isinstance(m, FSDPModule) for m in module.modules())
