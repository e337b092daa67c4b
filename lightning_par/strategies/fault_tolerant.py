"""FaultTolerantReplicas: the Lightning side of fault-tolerant HSDP across replica groups (torchft), mixed into
:class:`~lightning_par.strategies.zero.ZeroStrategy` (``fault_tolerance={...}``). The torchft side is
``lightning_par/health/fault_tolerance.py``.

A step under Lightning: the quorum starts at the batch's start (``on_train_batch_start``; torchft's
``Optimizer.zero_grad`` would start it, but Lightning zeroes gradients after ``training_step``), backward
all-reduces across the groups, and Lightning's optimizer step goes through :class:`StepThroughManager` (the closure,
then ``torchft.Optimizer.step()``: ``should_commit`` decides).

A restarted group heals in its first quorum, which runs to its end at the end of ``setup()``: the sender's state
holds, besides the model shards and optimizer states, the trainer's part of a checkpoint (loops with the data
loader's position, schedulers, callbacks, ``global_step``) as the sender took it after its last batch. That part is
handed to Lightning's own restore (as a checkpoint loaded from a file would be), so the healed group's loop starts at
the sender's next batch; its first step, on that batch, contributes zeros, and ``should_commit`` then loads the model
and optimizer states and applies the averaged gradient: the group leaves that step equal to the others.
"""

from __future__ import annotations

import copy
import traceback
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_par.layout.config import ParallelConfig
from lightning_par.parallel.ddp import global_tokens
from lightning_par.health import fault_tolerance as ft

__all__ = ["FaultTolerantReplicas", "check_fault_tolerance", "trainer_state"]


def check_fault_tolerance(option: dict[str, Any] | None, config: ParallelConfig) -> ft.FaultTolerance | None:
    """The ``fault_tolerance`` option resolved, or a ValueError naming what it cannot be combined with."""
    if option is None:
        return None
    if not config.zero.shards_parameters:
        raise ValueError(f"fault_tolerance needs zero_stage=3 (FSDP2, whose units all-reduce across replica groups "
                         f"through torchft); zero_stage={config.zero_stage} is not supported")
    if config.dp_replicate != 1:
        raise ValueError(f"fault_tolerance with replicate_size={config.dp_replicate}: the replica groups are the "
                         "replicas (fault_tolerance.replica_groups); each group shards only, so use replicate_size=1")
    if config.pp != 1:
        raise ValueError(f"fault_tolerance with {config.named('pp')}: pipeline parallel is not supported; use "
                         f"{config.name('pp')}=1")
    resolved = ft.FaultTolerance.from_option(option)
    if not ft.torchft_available():
        raise ImportError("fault_tolerance needs torchft: pip install torchft-nightly==2026.10.26")
    return resolved


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """The trainer's part of a checkpoint, as ``dump_checkpoint`` writes it, without the model and optimizer states
    (those travel separately, as live shards): a copy, safe to send from torchft's quorum thread."""
    state: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": {},
        "loops": trainer._checkpoint_connector._get_loops_state_dict(),
        "callbacks": call._call_callbacks_state_dict(trainer),
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    precision = trainer.precision_plugin.state_dict()
    if precision:
        state[type(trainer.precision_plugin).__qualname__] = precision
    datamodule = trainer.datamodule
    if datamodule is not None and (data_state := datamodule.state_dict()):
        state[type(datamodule).__qualname__] = data_state
    return copy.deepcopy(state)


def _from_quorum(exception: BaseException) -> bool:
    """Whether ``exception`` was raised by torchft's quorum (in its thread, re-raised where a step waited for it)."""
    frames = traceback.extract_tb(exception.__traceback__)
    return any(frame.name in ("_async_quorum", "wait_quorum", "start_quorum") for frame in frames)


class _TakeTrainerState(Callback):
    """Takes the trainer's state after every batch (where ModelCheckpoint would save it), for a group to heal from."""

    def __init__(self, strategy: FaultTolerantReplicas) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.strategy._trainer_state = trainer_state(trainer)


class FaultTolerantReplicas:
    """Strategy mixin: with ``_fault_tolerance`` set, this launch is one replica group of a torchft job. Without it
    every hook passes straight through."""

    _fault_tolerance: ft.FaultTolerance | None = None
    _ft_manager: Any = None
    _ft_optimizer: Any = None
    _ft_store: Any = None
    _trainer_state: dict[str, Any] | None = None
    _healed_trainer_state: dict[str, Any] | None = None  # received at set-up, until Lightning has restored it
    _quorum_ready = False  # the first quorum ran in setup(): the first batch uses it
    _heal_applied_by_lightning = False  # the first heal's trainer part was restored by Lightning already

    @property
    def fault_tolerance_manager(self) -> Any:
        """torchft's Manager of this rank (from set-up on, when training with ``fault_tolerance``), else None."""
        return self._ft_manager

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = super().distributed_sampler_kwargs  # type: ignore[misc]
        if self._fault_tolerance is None:
            return kwargs
        replicas, rank = ft.data_parallel_split(self._fault_tolerance, kwargs["num_replicas"], kwargs["rank"])
        return {**kwargs, "num_replicas": replicas, "rank": rank}

    @override
    def setup_environment(self) -> None:
        if self._fault_tolerance is not None:
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
            if trainer.accumulate_grad_batches > 1:
                # A quorum per optimizer step would need the micro-batch count in on_train_batch_start; not done yet.
                raise ValueError(f"fault_tolerance with accumulate_grad_batches={trainer.accumulate_grad_batches} is "
                                 "not supported; use accumulate_grad_batches=1 (a larger batch_size instead)")
        super().setup_environment()  # type: ignore[misc]

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if self._fault_tolerance is not None and trainer.state.fn == TrainerFn.FITTING:
            self._start_fault_tolerance(trainer)

    def _start_fault_tolerance(self, trainer: Trainer) -> None:
        config = self._fault_tolerance
        assert config is not None
        if len(self.optimizers) != 1:  # type: ignore[attr-defined]
            raise ValueError(f"fault_tolerance steps one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}")  # type: ignore[attr-defined]
        from torchft import Optimizer as ManagedOptimizer

        store, self._ft_store = ft.group_store(self.broadcast, self.global_rank)  # type: ignore[attr-defined]
        manager = ft.make_manager(config, rank=self.global_rank, world_size=self.world_size,  # type: ignore[attr-defined]
                                  store=store)
        self._ft_manager = manager
        optimizer = self.optimizers[0]  # type: ignore[attr-defined]
        ft.average_across_replicas(self.model, manager)  # type: ignore[attr-defined]
        ft.ReplicaState(manager, self.lightning_module, optimizer,  # type: ignore[attr-defined]
                        extra=self._state_to_send, load_extra=self._load_trainer_state)
        self._ft_optimizer = ManagedOptimizer(manager, optimizer)
        # What a group healing in this first quorum gets: at step 0 (torchft's init_sync: every group takes one group's
        # initial weights) the trainer's state before any batch, which the healing groups need not restore.
        self._trainer_state = trainer_state(trainer)
        # A heal in the first quorum (at step 0 inside first_quorum, or at the first batch's should_commit) has its
        # trainer part restored below or not at all; a later heal is one in the middle of the run.
        self._heal_applied_by_lightning = True
        self._quorum_ready, healed = ft.first_quorum(manager, self.root_device)  # type: ignore[attr-defined]
        self._heal_applied_by_lightning = healed is not None
        if healed is not None:
            rank_zero_info(f"{type(self).__name__}: replica group {config.replica_group_id} heals at step "
                           f"{manager.current_step()} (the sender's global_step {healed.get('global_step')})")
            self._healed_trainer_state = healed
            # Lightning restores what its checkpoint connector holds after setup() (restore_checkpoint_after_setup):
            # loops (with the stateful loader's position), schedulers and callbacks, as from a file.
            trainer._checkpoint_connector._loaded_checkpoint = healed

    def _state_to_send(self) -> dict[str, Any]:
        if self._trainer_state is None:
            raise RuntimeError("asked for the trainer's state before training started")
        return self._trainer_state

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        """Called by ``should_commit`` with the healed state's trainer part (main thread)."""
        if self._heal_applied_by_lightning:
            self._heal_applied_by_lightning = False  # restored at set-up, through Lightning's checkpoint restore
            return
        # Healed in the middle of the run (this group fell behind a quorum): model and optimizer are the sender's, and
        # the schedulers too (they step after this batch, as the sender's did); the loop's counters and the data
        # position are not rewound from inside a step.
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        rank_zero_warn(f"replica group {self._fault_tolerance.replica_group_id} was healed during its run at torchft "  # type: ignore[union-attr]
                       f"step {self._ft_manager.current_step()}: weights, optimizer and schedulers now match the other "
                       f"groups, but its global_step ({trainer.global_step}, theirs {state['global_step']}) and data "
                       "position do not")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._healed_trainer_state is not None:
            # A healing group resumes from the other groups' state, not from the file (its weights come from them).
            rank_zero_info(f"{type(self).__name__}: healing from the other replica groups; {checkpoint_path} is not "
                           "read")
            return self._healed_trainer_state
        return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if self._ft_manager is None:
            return
        self._healed_trainer_state = None  # restored by now
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        self._trainer_state = trainer_state(trainer)
        if not any(isinstance(c, _TakeTrainerState) for c in trainer.callbacks):
            trainer.callbacks.append(_TakeTrainerState(self))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._ft_manager is None:
            return
        if self._quorum_ready:  # the quorum of set-up serves the first step
            self._quorum_ready = False
            return
        self._ft_manager.start_quorum()  # runs behind the forward pass; waits for the previous one first

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._ft_optimizer is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        stepped = ft.StepThroughManager(optimizer, self._ft_optimizer, self._not_committed)
        return super().optimizer_step(stepped, closure, model, **kwargs)  # type: ignore[misc]

    def _token_share(self, batch: Any) -> Any:
        """For a model that means its loss over the tokens ``loss_tokens`` counts: this rank's share of the tokens of
        every group taking part, not of its own group only (``parallel/ddp.py``'s ``token_share`` is over the group's
        ranks; across groups the gradients are averaged, so the groups' token totals are too). One all-reduce of a
        number over torchft's groups per step."""
        count_tokens = getattr(self.lightning_module, "loss_tokens", None)  # type: ignore[attr-defined]
        if self._ft_manager is None or count_tokens is None:
            return super()._token_share(batch)  # type: ignore[misc]
        count = count_tokens(self.lightning_module.split_batch(batch)[1])  # type: ignore[attr-defined]
        mean_total = global_tokens(count, self.mesh)  # type: ignore[attr-defined]
        self._ft_manager.allreduce(mean_total).wait()  # the mean of the participating groups' totals
        share = count.to(torch.float64) * self.mesh.size("dp") / mean_total.clamp(min=1)  # type: ignore[attr-defined]
        return share.to(torch.float32)

    def _not_committed(self) -> None:
        """A group failed inside this step and torchft did not apply it: like a skipped bad step, its batch is
        consumed and it counts toward ``max_steps``, but the LR schedulers stay (``steps.py``)."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        self._hold_schedulers()  # type: ignore[attr-defined]
        rank_zero_warn(f"step {trainer.global_step} was not committed by torchft (a replica group failed in it): "
                       "its update is not applied")

    def _writes_checkpoints(self) -> bool:
        """One replica group writes the run's checkpoints, the others hold the same state: during training the
        first group of the step's quorum (torchtitan's rule: ``participating_rank() == 0``), outside it group 0.
        Two groups never write, or remove, one path."""
        if self._fault_tolerance is None:
            return True
        if self._ft_manager is None:
            return self._fault_tolerance.replica_group_id == 0
        return self._ft_manager.participating_rank() == 0

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._writes_checkpoints():
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._writes_checkpoints():
            super().remove_checkpoint(filepath)  # type: ignore[misc]

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._fault_tolerance is not None and _from_quorum(exception):
            # torchft's own error is a bare timeout ("Timeout expired") from its quorum thread.
            exception.add_note(f"lightning_par: the torchft quorum failed; is the lighthouse "
                               f"{self._fault_tolerance.lighthouse} up? Every replica group needs it for every step")
        super().on_exception(exception)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        if self._ft_manager is not None:
            manager, self._ft_manager, self._ft_optimizer = self._ft_manager, None, None
            manager.shutdown(wait=False)
        super().teardown()  # type: ignore[misc]
