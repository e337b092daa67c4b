"""One rank of a fault-tolerant HSDP run (one replica group under torchrun), launched by test_fault_tolerance.py.

The tiny Llama on synthetic tokens, ZeRO-3 inside the group, torchft across the groups
(``ZeroStrategy(fault_tolerance=...)``; the lighthouse and the group come from ``$TORCHFT_LIGHTHOUSE`` and
``$REPLICA_GROUP_ID``). ``--reference`` runs plain HSDP instead (``replicate_size=2`` over all the ranks torchrun
starts), the run the replica groups must reproduce.

- ``--steps N``: stop at global step N (without ``--until``: Lightning's ``max_steps``);
- ``--until N``: train until global step >= N in a step where every replica group took part (all groups stop at
  the same step: they see the same quorum); ``--steps`` is then only a bound;
- ``--fail-at S``: group 1's rank 0 leaves (``os._exit``) at the start of global step S, in torchrun's first attempt;
- ``--fail-in-recovery``: group 1's rank 0 leaves again in torchrun's second attempt, after its first quorum (which
  heals it) and before its first step;
- ``--step-sleep T``: each step sleeps T seconds after it (a longer step: a restarted group rejoins after fewer steps);
- ``--spares``: the global batch fixed at ``--min-replicas`` groups, the other group a spare;
- ``--checkpoints DIR``: every group's ModelCheckpoint saves every 10 steps into this one directory.

Each rank writes ``g<G>_r<rank>_a<attempt>.pt`` in ``--out``: per step its global step, torchft step, participants,
loss and wall time (without the sleep), and ``step_g<G>_r<rank>`` its last global step; at the end its global step, its local weight shards and optimizer states.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_par import ZeroStrategy
from lightning_par.data import TokenDataModule
from lightning_par.models import LlamaLM


class Record(lightning.Callback):
    """Each step's numbers, and the injected failure."""

    def __init__(self, args: argparse.Namespace, group: int, rank: int, attempt: int) -> None:
        self.args, self.group, self.rank, self.attempt = args, group, rank, attempt
        self.steps: list[dict] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (self.group == 1 and self.rank == 0 and self.attempt == 0 and trainer.global_step == self.args.fail_at):
            Path(self.args.out, "fault").write_text(str(time.time()))
            os._exit(3)
        self._start = time.monotonic()

    def on_fit_start(self, trainer, pl_module) -> None:
        # After the strategy's set-up: a restarted group has run its first quorum and holds the healing state.
        if self.group == 1 and self.rank == 0 and self.attempt == 1 and self.args.fail_in_recovery:
            Path(self.args.out, "fault_in_recovery").write_text(str(time.time()))
            os._exit(3)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = time.monotonic() - self._start
        manager = getattr(trainer.strategy, "fault_tolerance_manager", None)
        participants = manager.num_participants() if manager is not None else None
        self.steps.append({"global_step": trainer.global_step, "loss": float(outputs["loss"]),
                           "torchft_step": manager.current_step() if manager is not None else None,
                           "participants": participants, "seconds": seconds, "time": time.time()})
        Path(self.args.out, f"step_g{self.group}_r{self.rank}").write_text(str(trainer.global_step))
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        if self.args.until and trainer.global_step >= self.args.until and participants == 2:
            trainer.should_stop = True


class MaskedLlamaLM(LlamaLM):
    """The loss taken on the targets not divisible by 3 only, so that every rank's batch takes it on another number
    of tokens (as prompt masking does): the groups' token totals differ and a plain average of their means would not
    be HSDP's mean over all tokens."""

    def loss_fn(self, logits, targets):
        kept = self.loss_tokens(targets)
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        return (losses * (targets.flatten() % 3 != 0)).sum() / kept.clamp(min=1)

    def loss_tokens(self, targets):
        return (targets % 3 != 0).sum()


def local(value):
    return value.to_local().detach().clone() if isinstance(value, DTensor) else value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--until", type=int, default=0)
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--fail-in-recovery", action="store_true")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--spares", action="store_true")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--checkpoints", default=None, help="a ModelCheckpoint every 10 steps into this directory")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    Path(args.out).mkdir(parents=True, exist_ok=True)

    if args.reference:
        strategy = ZeroStrategy(zero_stage=3, replicate_size=2, timeout=timedelta(seconds=60))
    else:
        strategy = ZeroStrategy(zero_stage=3, timeout=timedelta(seconds=60),
                                fault_tolerance={"replica_groups": 2, "min_replicas": args.min_replicas,
                                                 "spares": args.spares, "timeout": 30, "quorum_timeout": 90})
    torch.manual_seed(1234)
    record = Record(args, group, rank, attempt)
    checkpoints = ([ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=10, save_top_k=-1)]
                   if args.checkpoints else [])
    trainer = lightning.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                                callbacks=[record, *checkpoints], logger=False, enable_checkpointing=bool(checkpoints),
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                limit_val_batches=0)
    module = MaskedLlamaLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, learning_rate=1e-2,
                     warmup_steps=2, max_steps=args.steps)
    # Global batch 2 samples x 4 data-parallel ranks; enough samples that a run stays in its first epoch.
    data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=2, num_samples=8 * args.steps)
    trainer.fit(module, datamodule=data)
    optimizer = trainer.optimizers[0].state_dict()
    state = {k: {name: local(v) for name, v in s.items()} for k, s in optimizer["state"].items()}
    torch.save({"steps": record.steps, "global_step": trainer.global_step, "attempt": attempt,
                "weights": {k: local(v) for k, v in module.state_dict().items()},
                "optimizer": state, "param_groups": optimizer["param_groups"]},
               Path(args.out, f"{'ref' if args.reference else f'g{group}'}_r{rank}_a{attempt}.pt"))


if __name__ == "__main__":
    main()
