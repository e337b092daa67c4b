"""The planner's prediction against a measured run on this machine's CPU ranks, before and after calibration.

    python benchmarks/planner_cpu.py [--strategy data_parallel|auto_parallel] [--devices 2] [--steps 40]
                                     [--warmup 10] [--dim 128 --layers 4 --seq-len 128 --batch-size 8]

``configs/data_parallel.yaml``'s run (the reference Llama model, dim 128, 4 layers, 0.8 M parameters; sequences of
128 tokens, 8 per rank; 2 CPU processes over gloo, fp32) trains on synthetic tokens without logger, validation or
progress bar, so that the timed loop is the training step. At start-up every rank measures the machine
(:func:`lightning_par.planner.measure.measure_rates`, what ``AutoParallelStrategy(calibrate=True)`` does before it
plans), and the step-time model predicts the run's layout twice: on the ``cpu`` data-sheet preset ("before") and on
the measured cluster ("after"). The steps after ``--warmup`` are timed on every rank; a step's time is the slowest
rank's, and the measured throughput is the global batch over the median step. MFU is model FLOPs per second per
rank over a peak: the prediction's own peak (1 TFLOP/s on the data sheet; the measured 1024^3 matmul after
calibration), and for the measurement the measured matmul, as ``ThroughputMonitor`` logs it. The ranks measure the
machine again after training: the spread between the two calibrations is the machine's drift during the run.

``--strategy auto_parallel`` runs ``AutoParallelStrategy(calibrate=True)`` instead: the planner measures, chooses
the layout and predicts it; "before" is the data sheet's prediction for the layout it chose.
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


def worker(args: argparse.Namespace) -> None:
    import lightning
    import torch

    import lightning_par
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM
    from lightning_par.planner import ClusterSpec, ModelSpec
    from lightning_par.planner.measure import measure_rates, measured_cluster
    from lightning_par.planner.time import estimate_step_time

    torch.set_num_threads(1)  # what the strategy gives each of 2 processes on 2 cores

    class Timed(lightning.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.result: dict = {}

        def _calibrate(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> dict:
            spec = ModelSpec.from_module(module)
            strategy = trainer.strategy
            if args.strategy == "auto_parallel":
                candidate = strategy.planned_layouts[0]
                config, mbs, microbatches = candidate.config, candidate.microbatch_size, candidate.microbatches
            else:
                config, mbs, microbatches = strategy.parallel_config, args.batch_size, 1
            rates = measure_rates(spec, seq_len=args.seq_len, microbatch_size=mbs, precision="32-true",
                                  local_world_size=args.devices)
            clusters = {"data sheet": ClusterSpec.from_preset("cpu", devices_per_node=args.devices),
                        "measured": measured_cluster(rates, devices_per_node=args.devices, collective_overlap=0.0)}
            if args.strategy == "auto_parallel":
                clusters["planned"] = strategy.planned_cluster
            predicted = {}
            for name, cluster in clusters.items():
                step = estimate_step_time(spec, config, cluster, seq_len=args.seq_len, microbatch_size=mbs,
                                          microbatches=microbatches, precision="32-true")
                predicted[name] = {"tokens_per_second": step.tokens_per_second, "mfu": step.mfu(cluster, "32-true"),
                                   "step": step.total, "work": step.work, "exposed": step.exposed}
            return {"layout": config.describe(), "rates": rates.__dict__, "predicted": predicted,
                    "flops_per_token": spec.flops_per_token(args.seq_len), "tokens_per_step": step.tokens}

        def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
            self.result["start"] = self._calibrate(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())

        def on_train_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
            self.result["end"] = self._calibrate(trainer, pl_module)
            self.result["steps"] = [b - a for a, b in zip(self.ends, self.ends[1:])][args.warmup:]
            Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(self.result))

    strategy = (lightning_par.AutoParallelStrategy(calibrate=True) if args.strategy == "auto_parallel"
                else lightning_par.DataParallelStrategy(bucket_cap_mb=25))
    torch.manual_seed(0)
    model = LlamaLM(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                    max_seq_len=args.seq_len)
    data = TokenDataModule(source="synthetic", vocab_size=256, seq_len=args.seq_len, batch_size=args.batch_size,
                           num_samples=8192)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                                callbacks=[Timed()], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("data_parallel", "auto_parallel"), default="data_parallel")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/run"
        shared = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
                   *(f"--{k.replace('_', '-')}={v}" for k, v in shared.items())]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.devices)]
    # Every rank agreed on the same calibration; a step lasts as long as its slowest rank.
    steps = [max(times) for times in zip(*(r["steps"] for r in ranks))]
    start, end = ranks[0]["start"], ranks[0]["end"]
    step = statistics.median(steps)
    tokens_per_second = start["tokens_per_step"] / step
    flops_per_rank = tokens_per_second * start["flops_per_token"] / args.devices
    mfu = flops_per_rank / start["rates"]["peak_flops"]
    print(f"{args.strategy}: {start['layout']}, dim={args.dim} layers={args.layers} seq={args.seq_len} "
          f"batch/rank={args.batch_size}, {args.devices} CPU ranks, {len(steps)} timed steps")
    rates = start["rates"]
    print(f"measured at start-up (slowest rank): matmul peak {rates['peak_flops'] / 1e9:.1f} GFLOP/s, projections "
          f"{rates['linear_flops'] / 1e9:.1f}, attention {rates['attention_flops'] / 1e9:.1f}, element-wise "
          f"{rates['memory_bandwidth'] / 1e9:.2f} GB/s, AdamW {rates['optimizer_rate'] / 1e6:.0f} M params/s, all-reduce "
          f"{(rates['link_bandwidth'] or 0) / 1e9:.2f} GB/s")
    print(f"measured run: median step {step * 1e3:.1f} ms (quartiles "
          f"{statistics.quantiles(steps, n=4)[0] * 1e3:.1f}-{statistics.quantiles(steps, n=4)[2] * 1e3:.1f}), "
          f"{tokens_per_second:,.0f} tokens/s, MFU {mfu:.1%} of the measured matmul peak")
    print(f"{'prediction':<34}{'step ms':>9}{'tokens/s':>11}{'ratio':>7}{'MFU':>8}{'ratio':>7}")
    rows = [("data sheet (cpu preset)", start["predicted"]["data sheet"]),
            ("calibrated at start-up", start["predicted"]["measured"]),
            ("calibrated after training", end["predicted"]["measured"])]
    if "planned" in start["predicted"]:
        rows.insert(1, ("planned by auto_parallel", start["predicted"]["planned"]))
    for name, p in rows:
        print(f"{name:<34}{p['step'] * 1e3:>9.1f}{p['tokens_per_second']:>11,.0f}"
              f"{p['tokens_per_second'] / tokens_per_second:>7.2f}{p['mfu']:>8.1%}{p['mfu'] / mfu:>7.2f}")


if __name__ == "__main__":
    main()
