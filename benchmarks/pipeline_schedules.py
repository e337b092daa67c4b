"""Pipeline schedules side by side: throughput of GPipe, 1F1B, interleaved 1F1B and ZB-V at pp=2 and pp=4.

    python benchmarks/pipeline_schedules.py [--pp 2 4] [--steps 20] [--microbatches 8] [--layers 8]

Each (pp, schedule) trains the reference Llama model with ``pipeline_parallel`` on ``pp`` CPU processes
(gloo) for ``--steps`` optimizer steps, the same global batch for all; the first ``--warmup`` steps are
not timed. Reported: median step time of the slowest rank, tokens per second, and each as a ratio to
GPipe at the same pp; the pipeline bubble as the strategy measures it (``BubbleMeter``: median over the
timed steps of the slowest rank's idle share, transfers and load included) beside the bubble the schedule's
recorded order of actions implies with equal costs (``simulated_bubble``, what the tests assert). On a
2-core machine more processes than cores share the CPU, so compare schedules within one pp rather than
across pp.
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

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")


def worker(args: argparse.Namespace) -> None:
    import lightning
    import torch

    from lightning_par import PipelineParallelStrategy
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM

    torch.set_num_threads(1)

    class StepTimer(lightning.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.bubbles: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._start)
            self.bubbles.append(trainer.strategy.parallelized.pipeline.bubble_fraction)

        def on_train_end(self, trainer, pl_module):
            meter = trainer.strategy.parallelized.pipeline.bubble
            record = {"times": self.times[args.warmup:], "bubbles": self.bubbles[args.warmup:],
                      "actions": meter.actions, "n_stages": meter.n_stages}
            Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(record))

    torch.manual_seed(0)
    model = LlamaLM(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, max_seq_len=args.seq_len)
    data = TokenDataModule(source="synthetic", seq_len=args.seq_len, batch_size=args.batch_size, num_samples=4096)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=args.worker_pp, pipeline_schedule=args.worker_schedule,
                                        microbatches=args.microbatches)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.worker_pp, strategy=strategy, max_steps=args.steps,
                                callbacks=[StepTimer()], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--worker-pp", type=int)
    parser.add_argument("--worker-schedule", choices=SCHEDULES)
    parser.add_argument("--out")
    return parser


def main() -> None:
    from lightning_par.parallel.bubble import simulated_bubble

    args = build_parser().parse_args()
    if args.worker_schedule:
        worker(args)
        return
    shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("steps", "warmup", "microbatches", "dim", "layers", "seq_len", "batch_size")]
    tokens = args.batch_size * args.seq_len
    print(f"dim={args.dim} layers={args.layers} seq={args.seq_len} batch={args.batch_size} "
          f"microbatches={args.microbatches}, {args.steps - args.warmup} timed steps")
    print(f"{'pp':>3} {'schedule':<18}{'step (ms)':>10}{'tokens/s':>10}{'vs gpipe':>10}{'bubble':>8}{'implied':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.pp:
            medians: dict[str, float] = {}
            for schedule in args.schedules:
                out = f"{tmp}/{pp}-{schedule}"
                subprocess.run([sys.executable, os.path.abspath(__file__), f"--worker-pp={pp}",
                                f"--worker-pipeline_schedule={schedule}", f"--out={out}", *shared], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"})
                ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(pp)]
                medians[schedule] = statistics.median(max(step) for step in zip(*(r["times"] for r in ranks)))
                base = medians.get("gpipe", medians[schedule])
                measured = statistics.median(max(step) for step in zip(*(r["bubbles"] for r in ranks)))
                implied = max(simulated_bubble({rank: [tuple(a) for a in record["actions"]]
                                                for rank, record in enumerate(ranks)},
                                               n_stages=ranks[0]["n_stages"]).values())
                print(f"{pp:>3} {schedule:<18}{medians[schedule] * 1e3:>10.1f}{tokens / medians[schedule]:>10.0f}"
                      f"{base / medians[schedule]:>10.2f}{measured:>8.3f}{implied:>9.3f}")


if __name__ == "__main__":
    main()
