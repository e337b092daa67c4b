"""ShardedCheckpoints: Lightning's checkpoint hooks for every lightning_par strategy (``lightning_par/checkpoint/format.py``
does the work in plain PyTorch).

- A checkpoint is a sharded ``torch.distributed.checkpoint`` directory (reshardable across layouts) or, with
  ``save_distributed_checkpoint=False``, one full file that rank 0 writes. Either is written under a staging name
  and renamed into place, so a save that fails leaves the last good checkpoint visible and nothing half-written.
- With ``async_save=True`` (or Lightning's ``AsyncCheckpointIO`` plugin), sharded saves are written in the background
  (``torch.distributed.checkpoint.async_save``) over a gloo group of their own while training goes on.
- Each rank's RNG states go into the checkpoint and are put back at the first batch after a resume
  (``strategies/resilience.py``); loading checks the files before reading them (``checkpoint_validation``).
- States are loaded into the parallelized module and its optimizers in place, after set-up.
- Under SLURM with auto-requeue, a preempted job saves on every rank at the same point and is requeued
  (:class:`~lightning_par.strategies.resilience.RequeueOnPreemption`, added at the start of training).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import lightning
import torch
from lightning.fabric.utilities.seed import _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.checkpoint import format as ckpt
from lightning_par.checkpoint.object_store import Location, location
from lightning_par.checkpoint.validation import CheckpointError
from lightning_par.checkpoint.adapters import base_reference, check_base
from lightning_par.parallel.modules import tied_aliases
from lightning_par.strategies.processes import MeshProcesses
from lightning_par.strategies.resilience import (
    RNG_STATES_KEY,
    RequeueOnPreemption,
    gather_rng_states,
    rng_states_of_rank,
    slurm_requeue_environment,
)


_ASYNC_NEEDS_SHARDS = ("{asked} writes through torch.distributed.checkpoint.async_save, which writes the sharded "
                       "format: keep save_distributed_checkpoint=True, or save synchronously")


class ShardedCheckpoints(MeshProcesses):
    """Saving, loading and consolidating checkpoints of a module laid out on ``self.mesh``."""

    def __init__(self, *, save_distributed_checkpoint: bool, async_save: bool, checkpoint_weights_only: bool,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if async_save and not save_distributed_checkpoint:
            raise ValueError(_ASYNC_NEEDS_SHARDS.format(asked="async_save=True"))
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._async_save = async_save
        self._checkpoint_weights_only = checkpoint_weights_only
        self._rng_states_to_restore: dict[str, Any] | None = None  # put back at the first batch after a resume
        self._pending_save: Future | None = None  # an asynchronous save still being written
        self._checkpoint_group: torch.distributed.ProcessGroup | None = None
        self._base_reference: dict[str, str] | None = None  # the frozen base directory's, once read

    @property
    def _saves_asynchronously(self) -> bool:
        return self._async_save or isinstance(self._checkpoint_io, AsyncCheckpointIO)

    def _check_checkpoint_format(self) -> None:
        if self._saves_asynchronously and not self._save_distributed_checkpoint:
            raise ValueError(_ASYNC_NEEDS_SHARDS.format(asked="the AsyncCheckpointIO plugin"))

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states are loaded into the parallelized module and its optimizers, so they must exist first

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint() already restored them

    def _frozen_base(self) -> str | None:
        """The directory the module's frozen parameters are read from (``HFCausalLM(lora=...)``'s ``frozen_base``):
        its checkpoints then hold only the trainable parameters, and a reference to that directory."""
        return getattr(self.lightning_module, "frozen_base", None)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.model_state_dict(self.lightning_module, full=not self._save_distributed_checkpoint, aliases=False,
                                     trainable_only=self._frozen_base() is not None)

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
        path = location(self.broadcast(str(filepath)))  # one path for every rank
        self._finish_pending_save()
        self._enter(f"saving checkpoint {path}")
        checkpoint[RNG_STATES_KEY] = gather_rng_states(self.root_device)
        checkpoint[ckpt.TIED_KEY] = tied_aliases(self.lightning_module)
        base = self._frozen_base()
        if base is not None and self.is_global_zero:  # rank 0 writes the entries beside the tensors
            if self._base_reference is None:  # the base does not change during a run: its files are read once
                self._base_reference = base_reference(base)
            checkpoint[ckpt.FROZEN_BASE_KEY] = self._base_reference
        self._write_checkpoint(checkpoint, path)
        # What runs next (the loop reading the next batch) is no longer the save.
        trainer = self.lightning_module._trainer
        self._enter(f"training after step {trainer.global_step}" if trainer is not None else f"after saving {path}")

    def _write_checkpoint(self, checkpoint: dict[str, Any], path: Location) -> None:
        """Write ``checkpoint`` (its tensors in the format chosen) to ``path``: now, or in the background when saves
        are asynchronous (a pending save must be finished first: :meth:`_finish_pending_save`)."""
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

    def _note_complete(self, path: Location) -> None:
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
        path = location(self.broadcast(str(checkpoint_path)))
        self._finish_pending_save()
        self._enter(f"loading checkpoint {path}")
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        checkpoint = ckpt.load_checkpoint(
            path, self.lightning_module, optimizers, strict=self.lightning_module.strict_loading,
            weights_only=self._checkpoint_weights_only if weights_only is None else weights_only,
        )
        checkpoint.pop(ckpt.TIED_KEY, None)  # load_checkpoint restored the ties already
        if checkpoint.pop(ckpt.FABRIC_KEY, None) is not None:
            # Written by a Fabric loop, which has neither Lightning's loops nor its schedulers: the Trainer starts at
            # step 0 from the weights and optimizer states.
            checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
            checkpoint.setdefault("lr_schedulers", [])
        reference = checkpoint.get(ckpt.FROZEN_BASE_KEY)  # kept: the module reads its base again (on_load_checkpoint)
        if reference is not None:
            self._check_frozen_base(reference, path)
        self._rng_states_to_restore = rng_states_of_rank(checkpoint.pop(RNG_STATES_KEY, None), self.global_rank,
                                                         self.world_size)
        return checkpoint

    def _check_frozen_base(self, reference: dict[str, str], path: Location) -> None:
        """Refuse, on every rank, a checkpoint of adapters whose base model is not the module's (its files changed, or
        the module has none). Rank 0 reads the files; the others wait for its verdict."""
        problem = None
        if self.is_global_zero:
            base = self._frozen_base()
            problem = (check_base(reference, base, source=str(path)) if base is not None else
                       f"checkpoint {str(path)!r} holds LoRA adapters only, for the base model in "
                       f"{reference['directory']!r}, and {type(self.lightning_module).__name__} reads no base model "
                       "directory: resume it with HFCausalLM(pretrained=<that directory>, lora=...)")
            if problem is None:
                self._base_reference = reference
        problem = self.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._rng_states_to_restore is not None:
            # Taken at the end of the batch before this one: the first draw of this batch continues the saved run.
            _set_rng_states(self._rng_states_to_restore)
            self._rng_states_to_restore = None

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
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint() loaded the weights in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint() loaded the optimizer states in place

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        if self._failed_with is None:
            self._finish_pending_save()
        super().teardown()

    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """Whole tensors of the model on CPU, on global rank 0 (other ranks get an empty dict). Collective."""
        assert self.lightning_module is not None
        mesh = self.mesh
        if mesh.size("pp") == 1:
            return ckpt.model_state_dict(self.lightning_module, full=True)
        # Each pipeline rank holds different parameters: assemble its stages' whole tensors (tensor-parallel
        # shards gathered), then gather every stage on rank 0.
        mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for k, v in ckpt.model_state_dict(self.lightning_module, full=False).items()}
        if any(index != 0 for name, index in mesh.coordinates().items() if name != "pp"):
            return {}  # a replica of what rank 0's pipeline group holds
        parts: list[Any] = [None] * mesh.size("pp") if self.global_rank == 0 else None
        torch.distributed.gather_object(mine, parts, dst=0, group=mesh.group("pp"))
        return {k: v for part in parts for k, v in part.items()} if self.global_rank == 0 else {}
