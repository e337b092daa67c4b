"""How long a checkpoint save stops training: synchronous saves against ``async_save=True``, same run, same machine.

    python benchmarks/checkpoint_stall.py [--strategy zero3] [--devices 2] [--steps 40] [--save-every 10]
                                          [--dim 512 --layers 8] [--rounds 2] [--root DIR]

Each mode trains the reference Llama model under ``--strategy`` on ``--devices`` CPU processes (gloo) for
``--steps`` steps; ``sync`` and ``async`` save a sharded checkpoint every ``--save-every`` steps with
``ModelCheckpoint`` (every save kept, so no save waits for another), ``none`` never saves. Rounds alternate the
order (none sync async, async sync none, ...) so that drift on a shared machine hits all alike. A step is timed
from the start of its batch to the start of the next, so a save made at its end counts in it. Reported per mode:

- the median step without a save, and the median step that saves, on the slowest rank;
- the stall: how much longer a saving step is than a step of ``none`` (what training loses per save);
- the whole run, from the first batch to the end of ``fit`` (which waits for the last background write), as a
  ratio to ``none``: a background write shares the CPU with training, and this says what that costs;
- the size of one checkpoint on disk.

Checkpoints go to a temporary directory under ``--root`` (default: the system's temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "sync", "async")


def worker(mode: str, args: argparse.Namespace) -> None:
    import lightning
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_par
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM

    torch.set_num_threads(1)

    class StepTimer(lightning.Callback):
        """The time from each batch's start to the next one's (a save at the end of a step counts in it)."""

        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.starts.append(time.perf_counter())

        def teardown(self, trainer, pl_module, stage):  # after the strategy waited for a pending save
            steps = [b - a for a, b in zip(self.starts, self.starts[1:])]
            result = {"steps": steps, "run": time.perf_counter() - self.starts[0]}
            Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(result))

    strategy_class = {"zero3": lightning_par.ZeroStrategy, "hybrid3d": lightning_par.Hybrid3DStrategy,
                      "data_parallel": lightning_par.DataParallelStrategy}[args.strategy]
    strategy = strategy_class(async_save=mode == "async")
    saves = [ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=args.save_every, save_top_k=-1)]
    torch.manual_seed(0)
    model = LlamaLM(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, max_seq_len=args.seq_len)
    data = TokenDataModule(source="synthetic", seq_len=args.seq_len, batch_size=args.batch_size, num_samples=8192)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                                callbacks=[StepTimer(), *(saves if mode != "none" else [])], logger=False,
                                enable_checkpointing=mode != "none", enable_progress_bar=False,
                                enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)


def run_one(mode: str, args: argparse.Namespace, folder: str) -> dict:
    out, checkpoints = f"{folder}/{mode}", f"{folder}/{mode}-checkpoints"
    shared = {k: v for k, v in vars(args).items() if k not in ("worker", "out", "checkpoints", "root")}
    command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", out, "--checkpoints", checkpoints,
               *(f"--{k.replace('_', '-')}={v}" for k, v in shared.items())]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.devices)]
    slowest = [max(step) for step in zip(*(r["steps"] for r in ranks))]
    saving = {step for step in range(len(slowest)) if mode != "none" and (step + 1) % args.save_every == 0}
    saved = sorted(Path(checkpoints).glob("*.ckpt")) if mode != "none" else []
    size = sum(f.stat().st_size for f in saved[0].rglob("*") if f.is_file()) if saved else 0
    return {"plain": [t for s, t in enumerate(slowest) if s not in saving and s >= args.warmup],
            "saving": [slowest[s] for s in sorted(saving)], "run": max(r["run"] for r in ranks), "bytes": size}


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("zero3", "hybrid3d", "data_parallel"), default="zero3")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the plain steps' median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--root", default=None, help="where the temporary checkpoint directories go")
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--out")
    parser.add_argument("--checkpoints")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    plain: dict[str, list[float]] = {mode: [] for mode in MODES}
    saving: dict[str, list[float]] = {mode: [] for mode in MODES}
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    size = 0
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            with tempfile.TemporaryDirectory(dir=args.root) as folder:
                result = run_one(mode, args, folder)
            plain[mode] += result["plain"]
            saving[mode] += result["saving"]
            runs[mode].append(result["run"])
            size = max(size, result["bytes"])
    base_step = statistics.median(plain["none"])
    base_run = statistics.median(runs["none"])
    print(f"{args.strategy} on {args.devices} processes, dim={args.dim} layers={args.layers}, {args.steps} steps, a "
          f"save every {args.save_every} ({size / 2**20:.0f} MiB each), {args.rounds} rounds; medians, slowest rank")
    print(f"{'mode':<8}{'step (ms)':>11}{'saving step (ms)':>18}{'stall/save (ms)':>17}{'run (s)':>9}{'ratio':>7}")
    for mode in MODES:
        step = statistics.median(plain[mode])
        save_step = statistics.median(saving[mode]) if saving[mode] else float("nan")
        run = statistics.median(runs[mode])
        print(f"{mode:<8}{step * 1e3:>11.1f}{save_step * 1e3:>18.1f}{(save_step - base_step) * 1e3:>17.1f}"
              f"{run:>9.2f}{run / base_run:>7.2f}")


if __name__ == "__main__":
    main()
