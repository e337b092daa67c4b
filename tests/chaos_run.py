"""One rank of the chaos run (test_resilience.py), started by ``torchrun --max-restarts N``: it trains the tiny Llama
under each layout of ``--layouts`` (names of LAYOUTS) in turn, 8 steps with a checkpoint every 2 and
``ckpt_path="auto"``, passing over the layouts an earlier attempt finished; the attempt ``--plan`` names kills one
rank at one point of one step:

- ``batch``: at the start of the step;
- ``backward``: between the backward and the optimizer step;
- ``on_save``: inside ``on_save_checkpoint`` of the step's save;
- ``write``: half-way through writing its part of the step's save (half a file left);
- ``replace``: rank 0 only, while it puts the step's save in the place of ``last.ckpt``, right after the old copy
  left the name (swapped with the new one, or moved aside).

``--plan`` is one ``layout:point:step:rank`` per attempt, comma-separated: attempt ``k`` (torchrun's
``TORCHELASTIC_RESTART_COUNT``) carries out entry ``k``; the attempts after the last entry run without a fault.
Every rank appends, per layout, the step each attempt started from and the loss of every step it finished to
``<out>/<layout>/rank<N>.jsonl``, and writes the final weights to ``<out>/<layout>/rank<N>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
import resilience_run  # noqa: E402

from lightning_par import DataParallelStrategy, Hybrid3DStrategy, ZeroStrategy  # noqa: E402
from lightning_par.data import TokenDataModule  # noqa: E402
from lightning_par.models import LlamaLM  # noqa: E402

TIMEOUT = timedelta(seconds=30)
LAYOUTS = {
    "data_parallel": lambda: DataParallelStrategy(timeout=TIMEOUT),
    "zero3": lambda: ZeroStrategy(zero_stage=3, timeout=TIMEOUT),
    "dp2xtp2": lambda: Hybrid3DStrategy(tensor_parallel_size=2, timeout=TIMEOUT),
}
ONLY_LAST = {"zero3", "dp2xtp2"}  # save_top_k=0: last.ckpt is the only copy
STEPS, SAVE_EVERY = 8, 2
POINTS = ("batch", "backward", "on_save", "write", "replace")


class Chaos(lightning.Callback):
    """Records each finished step's loss, and kills this rank where the attempt's fault says."""

    def __init__(self, records: Path, attempt: int, rank: int, fault: tuple[str, int] | None) -> None:
        self.records, self.attempt, self.rank, self.fault = records, attempt, rank, fault
        self.started = False

    def record(self, **entry: object) -> None:
        with self.records.open("a") as file:
            file.write(json.dumps({"attempt": self.attempt, **entry}) + "\n")

    def _at(self, point: str, trainer: lightning.Trainer, *, finished: bool) -> bool:
        step = trainer.global_step + (0 if finished else 1)
        return self.fault == (point, step)

    def on_train_start(self, trainer, pl_module) -> None:
        self.record(start=trainer.global_step)
        self.started = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._at("batch", trainer, finished=False):
            _die()
        if self._at("write", trainer, finished=False):
            resilience_run._die_while_writing()
        if self._at("replace", trainer, finished=False):
            resilience_run._die_in_replace()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._at("backward", trainer, finished=False):
            _die()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.record(step=trainer.global_step, loss=float(loss).hex())

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self._at("on_save", trainer, finished=True):
            _die()


def _die() -> None:
    resilience_run._note_fault()
    os.kill(os.getpid(), signal.SIGKILL)


def _fault_of(plan: str, attempt: int, layout: str, rank: int) -> tuple[str, int] | None:
    entries = [entry.split(":") for entry in plan.split(",") if entry]
    if attempt >= len(entries):
        return None
    name, point, step, killed = entries[attempt]
    assert point in POINTS, point
    return (point, int(step)) if name == layout and int(killed) == rank else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--plan", default="")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resilience_run.OUT = args.out
    for layout in args.layouts.split(","):
        out = Path(args.out, layout)
        out.mkdir(parents=True, exist_ok=True)
        if all((out / f"rank{r}.pt").is_file() for r in range(world_size)):
            continue  # an earlier attempt finished it
        torch.manual_seed(0)
        chaos = Chaos(out / f"rank{rank}.jsonl", attempt, rank, _fault_of(args.plan, attempt, layout, rank))
        checkpoints = ModelCheckpoint(dirpath=Path(args.dir, layout), every_n_train_steps=SAVE_EVERY,
                                      save_top_k=0 if layout in ONLY_LAST else -1, save_last=True)
        trainer = lightning.Trainer(
            accelerator="cpu", devices=world_size, strategy=LAYOUTS[layout](), max_steps=STEPS,
            callbacks=[chaos, checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=Path(args.dir, layout))
        module = LlamaLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, learning_rate=1e-2,
                         warmup_steps=2, max_steps=STEPS)
        data = TokenDataModule(source="synthetic", vocab_size=64, seq_len=16, batch_size=2, num_samples=64,
                               num_val_samples=8)
        trainer.fit(module, datamodule=data, ckpt_path="auto")
        if not chaos.started:  # resumed at the last step: Lightning starts no training, nor on_train_start
            chaos.record(start=trainer.global_step)
        torch.save(trainer.strategy.consolidated_state_dict(), out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
