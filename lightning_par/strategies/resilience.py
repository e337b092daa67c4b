"""Exact resume and SLURM preemption for every lightning_par strategy (the Lightning side).

- RNG states: Lightning's checkpoint holds no random-number generator state. Each rank's states (torch,
  CUDA, NumPy, Python) are gathered into the checkpoint at save and put back at the first training batch
  after a resume, the point at which they were taken, so dropout masks and any other draw continue as in
  an uninterrupted run. Together with the stateful training loader (``data/resumable.py``) and Lightning's
  own loop, optimizer and scheduler states this makes a resumed run repeat the uninterrupted one exactly.
- SLURM auto-requeue: Lightning saves a checkpoint inside the SIGUSR1 handler, on whichever rank got the
  signal, at whatever line it was running. A sharded save is a collective, so ranks that are elsewhere in
  the step (or did not get the signal) pair its collectives with the wrong ones and hang.
  :class:`RequeueOnPreemption` takes over the signal: the handler only takes note, and at the end of the
  next training batch every rank learns whether any rank was signalled (one all-reduce of one number, as
  Megatron-LM's exit-signal handler does each iteration); then all save ``hpc_ckpt_N.ckpt`` together,
  rank 0 asks SLURM to requeue the job, and training stops. The requeued job resumes from that checkpoint
  through Lightning's usual HPC resume (``ckpt_path=None`` under SLURM).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

log = logging.getLogger(__name__)

RNG_STATES_KEY = "lightning_par_rng_states"  # one entry per global rank


def gather_rng_states(root_device: torch.device) -> list[dict[str, Any]] | None:
    """Every rank's RNG states, on global rank 0 (None elsewhere). Collective."""
    mine = _collect_rng_states(include_cuda=root_device.type == "cuda")
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    states: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, states, dst=0)
    return states


def share_rng_states(group: dist.ProcessGroup, root_device: torch.device) -> None:
    """Give every rank of ``group`` the RNG states of its first rank. Collective over ``group``.

    Tensor-parallel ranks compute the activations between the split layers each in full, and context-parallel ranks
    the embedding of the whole sequence before the blocks cut it: a dropout there must draw the same mask on every
    one of them, or their copies of one activation drift apart (Megatron's model-parallel RNG tracker keeps these
    draws alike too). Where the layout gives them different activations, ``lightning_par.parallel.rng`` derives a
    stream per rank from these shared states. Seeding every rank alike does it; this does it for runs that did not
    seed, or seeded each rank its own way.
    """
    box = [_collect_rng_states(include_cuda=root_device.type == "cuda")]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    _set_rng_states(box[0])


def rng_states_of_rank(states: list[dict[str, Any]] | None, rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's saved states, or None (with a warning) when the checkpoint came from another world size."""
    if states is None:
        return None
    if len(states) != world_size:
        rank_zero_warn(f"the checkpoint holds the RNG states of {len(states)} ranks and this run has {world_size}: "
                       "random draws start afresh instead of continuing the saved run's")
        return None
    return states[rank]


def slurm_requeue_environment(trainer: Trainer) -> SLURMEnvironment | None:
    """The SLURM environment when Lightning's auto-requeue is on, else None."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and os.name != "nt":
        return environment
    return None


class RequeueOnPreemption(Callback):
    """On SLURM's requeue signal: save a checkpoint at a batch boundary on every rank, requeue, stop.

    Added by lightning_par's strategies when Lightning's SLURM auto-requeue is on; see the module docstring.
    """

    def __init__(self, environment: SLURMEnvironment) -> None:
        self.signum = environment.requeue_signal or signal.SIGUSR1
        self.signalled = False
        self._previous_handler: Any = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning has installed its own handler by now (just before the run starts): replace it.
        self._previous_handler = signal.signal(self.signum, self._take_note)

    def _take_note(self, signum: int, frame: Any) -> None:
        log.info(f"received signal {signum}: checkpoint and requeue at the end of this batch")
        self.signalled = True

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._any_rank_signalled(trainer):
            return
        self.signalled = False
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            _requeue()
        trainer.should_stop = True

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._previous_handler is not None:
            signal.signal(self.signum, self._previous_handler)
            self._previous_handler = None

    def _any_rank_signalled(self, trainer: Trainer) -> bool:
        flag = torch.tensor([float(self.signalled)], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _requeue() -> None:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"SLURM job id {job!r} is not a job id (digits, or ARRAYJOB_TASK)")
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.warning(f"cannot requeue SLURM job {job}: no `scontrol` on PATH")
        return
    if result.returncode == 0:
        log.info(f"requeued SLURM job {job}")
    else:
        log.warning(f"`scontrol requeue {job}` failed ({result.returncode}): {result.stderr.strip()}")
