"""One rank of a short data-parallel run, launched as its own process by test_resilience.py.

The environment says who this process is, as a launcher would set it: ``RANK``/``WORLD_SIZE``/``MASTER_*``
(srun-like independent processes or torchrun) or ``SLURM_*``; with none of them and ``--devices N``, Lightning's
subprocess launcher starts the other ranks. The run trains the tiny Llama for two epochs of four steps with a
checkpoint every three steps (``--async-save``: ``async_save=True``, written in the background), and can tell rank 1 to fail in a
given way:

- ``--kill-in-save STEP``: this rank SIGKILLs itself half-way through writing the checkpoint of ``STEP``;
- ``--hang-at STEP``: this rank stops in the training step ``STEP`` (alive, never reaching a collective);
- ``--signal-at STEP``: this rank sends itself SIGUSR1 (SLURM's requeue warning) in step ``STEP``;
- ``--stop-in-backward STEP``: this rank SIGSTOPs itself inside the backward of ``STEP``, while DDP's gradient
  all-reduce runs;
- ``--disk-full STEP``: writing this rank's part of the checkpoint of ``STEP`` fails with ENOSPC;
- ``--loader-fails-at STEP``: this rank's dataset raises when the batches after ``STEP`` are read;
- ``--fail-setup-rank R``: rank ``R`` (any rank) raises during set-up, after the process group is up;
- ``--kill-in-replace STEP``: rank 0 SIGKILLs itself while it puts the checkpoint of ``STEP`` in the place of the
  ``last.ckpt`` before it, right after the old copy has left that name (with ``--no-swap``: as on a filesystem that
  cannot swap, between its two renames).

``--only-last`` keeps ``last.ckpt`` alone (``save_top_k=0``).

Every rank writes its process id to ``pid<N>`` in ``--out`` at start, the time of an injected fault to ``fault``,
and ``rank<N>.pt`` at the end (losses, one RNG draw per step, final weights, last step).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from parity import RecordLoss  # noqa: E402

from lightning_par import DataParallelStrategy  # noqa: E402
from lightning_par.data import TokenDataModule  # noqa: E402
from lightning_par.models import LlamaLM  # noqa: E402


OUT = "."  # --out


class Misbehave(lightning.Callback):
    """Records one draw from the global RNG per step, and fails as the command line asks."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank, self.draws = args, rank, []

    def setup(self, trainer, pl_module, stage) -> None:
        if self.rank == self.args.fail_setup_rank:
            _note_fault()
            raise RuntimeError(f"injected: rank {self.rank} fails during set-up")

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step == 0:
            torch.manual_seed(100 * self.args.seed + self.rank)  # every rank's stream differs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.rank != 1:
            return
        step = trainer.global_step + 1
        if step == self.args.hang_at:
            time.sleep(3600)
        if step == self.args.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        if step == self.args.stop_in_backward:
            next(pl_module.parameters()).register_hook(lambda grad: _note_fault() or os.kill(os.getpid(), signal.SIGSTOP))
        if step == self.args.disk_full:
            _disk_full()
        if step == self.args.loader_fails_at:
            _loader_fails(trainer.train_dataloader.dataset)
        # Under torchrun, only the first attempt fails: the restarted one must get through.
        if step == self.args.kill_in_save and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            _die_while_writing()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.draws.append(torch.rand(1).item())  # continues exactly only if the RNG state was restored
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.rank == 0 and trainer.global_step == self.args.kill_in_replace and first_attempt:
            _die_in_replace(swap=not self.args.no_swap)  # before ModelCheckpoint saves, which Lightning runs last



def _die_while_writing() -> None:
    """From now on, writing this rank's part of a sharded checkpoint leaves half a file and kills the process."""
    from torch.distributed.checkpoint import FileSystemWriter

    def write_half_and_die(self, plan, planner):
        with self.fs.create_stream(self.fs.concat_path(self.path, "__half_written.distcp"), "wb") as stream:
            stream.write(b"\0" * 100)  # on disk or on an object store (fsspec)
        _note_fault()
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_half_and_die


def _die_in_replace(swap: bool = True) -> None:
    """The next checkpoint put in place kills this process as soon as the old copy has left its name, however it
    leaves: swapped with the new one, or moved into the staging folder (``swap=False``: as on a filesystem that
    cannot swap, between the two renames)."""
    from lightning_par.checkpoint import atomic

    def die() -> None:
        _note_fault()
        os.kill(os.getpid(), signal.SIGKILL)

    exchange, replace = (atomic.exchange if swap else lambda first, second: False), os.replace
    atomic.exchange = lambda first, second: exchange(first, second) and die()

    def replace_and_die(source, target):
        replace(source, target)
        if Path(target).parent.name == atomic.STAGING_DIR and Path(source).parent.name != atomic.STAGING_DIR:
            die()

    os.replace = replace_and_die


def _note_fault() -> None:
    """Record when the fault happens (the tests report how long after it every rank had gone)."""
    Path(OUT, "fault").write_text(str(time.time()))


def _disk_full() -> None:
    """From now on, writing this rank's part of a sharded checkpoint fails as a full disk makes it fail."""
    from torch.distributed.checkpoint import FileSystemWriter

    def no_space(self, plan, planner):
        _note_fault()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    FileSystemWriter.write_data = no_space


def _loader_fails(dataset) -> None:
    def broken(self, index):
        _note_fault()
        raise RuntimeError(f"injected: sample {index} cannot be read")

    type(dataset).__getitem__ = broken


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--stop-in-backward", type=int, default=-1)
    parser.add_argument("--disk-full", type=int, default=-1)
    parser.add_argument("--loader-fails-at", type=int, default=-1)
    parser.add_argument("--fail-setup-rank", type=int, default=-1)
    parser.add_argument("--kill-in-replace", type=int, default=-1)
    parser.add_argument("--no-swap", action="store_true")
    parser.add_argument("--only-last", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--devices", type=int, default=None)
    args = parser.parse_args()
    global OUT
    OUT = args.out

    torch.manual_seed(args.seed)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", 0))))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"pid{rank}").write_text(str(os.getpid()))
    devices = args.devices or int(os.environ.get("SLURM_NTASKS_PER_NODE", os.environ.get("WORLD_SIZE", 1)))
    recorder, misbehave = RecordLoss(), Misbehave(args, rank)
    checkpoints = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=3, save_top_k=0 if args.only_last else -1,
                                  save_last=True)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=devices, max_epochs=2,
        strategy=DataParallelStrategy(timeout=timedelta(seconds=args.timeout), async_save=args.async_save),
        callbacks=[recorder, misbehave, checkpoints], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=args.dir,
    )
    module = LlamaLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, learning_rate=1e-2,
                     warmup_steps=2, max_steps=8)
    # 16 samples / (batch 2 x 2 ranks) = 4 steps per epoch, shuffled.
    data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=2, num_samples=16,
                           num_val_samples=8)
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    state = trainer.strategy.consolidated_state_dict()
    torch.save({"losses": recorder.losses, "draws": misbehave.draws, "state": state, "step": trainer.global_step},
               Path(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
