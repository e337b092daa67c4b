"""data_parallel vs Lightning's own DDPStrategy: same model, same data, same machine, same run.

    python benchmarks/data_parallel_vs_ddp.py [--devices 2] [--steps 60] [--rounds 2]

Each strategy trains the reference Llama model for ``--steps`` optimizer steps on ``--devices`` CPU
processes (gloo); the first ``--warmup`` steps are not timed. Rounds alternate the order (A B, B A, ...)
so that drift on a shared machine hits both alike. Reported per strategy: median step time (the slowest
rank's), peak resident memory per rank (ru_maxrss), and the ratio data_parallel / DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ("lightning_ddp", "data_parallel")


def worker(strategy_name: str, args: argparse.Namespace) -> None:
    import lightning
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_par import DataParallelStrategy
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM

    torch.set_num_threads(1)

    class StepTimer(lightning.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._start)

        def on_train_end(self, trainer, pl_module):
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            result = {"step_times": self.times[args.warmup:], "peak_rss_mib": peak_mib}
            Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(result))

    strategy = DDPStrategy() if strategy_name == "lightning_ddp" else DataParallelStrategy()
    torch.manual_seed(0)
    model = LlamaLM(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, max_seq_len=args.seq_len)
    data = TokenDataModule(source="synthetic", seq_len=args.seq_len, batch_size=args.batch_size, num_samples=8192)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                                callbacks=[StepTimer()], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)


def run_one(strategy_name: str, args: argparse.Namespace, out: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", strategy_name, "--out", out,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out"))]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.devices)]
    slowest = [max(step) for step in zip(*(r["step_times"] for r in ranks))]
    return {"step_times": slowest, "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--worker", choices=STRATEGIES)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return

    samples: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    memory: dict[str, float] = {name: 0.0 for name in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = STRATEGIES if round_index % 2 == 0 else STRATEGIES[::-1]
            for name in order:
                result = run_one(name, args, f"{tmp}/{name}{round_index}")
                samples[name] += result["step_times"]
                memory[name] = max(memory[name], result["peak_rss_mib"])
    median = {name: statistics.median(times) for name, times in samples.items()}
    print(f"world size {args.devices}, {args.rounds} rounds x {args.steps - args.warmup} timed steps, "
          f"dim={args.dim} layers={args.layers} seq={args.seq_len} batch/rank={args.batch_size}")
    print(f"{'strategy':<16}{'median step (ms)':>18}{'peak RSS/rank (MiB)':>22}")
    for name in STRATEGIES:
        print(f"{name:<16}{median[name] * 1e3:>18.1f}{memory[name]:>22.0f}")
    print(f"step-time ratio data_parallel / lightning_ddp: {median['data_parallel'] / median['lightning_ddp']:.3f}")
    print(f"peak-memory ratio data_parallel / lightning_ddp: {memory['data_parallel'] / memory['lightning_ddp']:.3f}")


if __name__ == "__main__":
    main()
