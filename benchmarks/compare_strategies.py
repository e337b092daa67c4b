"""lightning_par strategies side by side with Lightning's own DDPStrategy: same model, data, machine, run.

    python benchmarks/compare_strategies.py [--strategies lightning_ddp data_parallel zero1 zero2 zero3
                                                          tensor_parallel context_parallel pipeline_parallel
                                                          hybrid3d]
                                            [--devices 2] [--steps 60] [--rounds 2] [--dim 128 --layers 4]
                                            [--hybrid-tp 2 --hybrid-pp 2 --microbatches 4]
                                            [--keep-gathered-blocks N|auto --prefetch-blocks N|auto --blocks-per-unit K|auto]
                                            [--optimizers adamw adamw_bf16 adamw_8bit adamw_4bit muon]

Each strategy trains the reference Llama model for ``--steps`` optimizer steps on ``--devices`` CPU
processes (gloo); the first ``--warmup`` steps are not timed. Rounds alternate the order (A B C, C B A,
...) so that drift on a shared machine hits all alike. ``--batch-size`` is per data-parallel rank, so the
model-parallel strategies (tensor_parallel: tp=2; context_parallel: cp=2, Ulysses) train on fewer samples
per step than data parallelism on the same processes (pipeline_parallel: one stage per process;
hybrid3d: tp x pp from ``--hybrid-tp/--hybrid-pp``, sequence parallel on, the rest data parallel). With ``--moe-experts`` every block is a mixture of
experts (top 2); ``expert_parallel`` then splits the experts over all processes, and ``data_parallel``
(experts replicated, ep=1) is its baseline. Reported per strategy: median step time (the
slowest rank's), throughput in tokens per second of the global batch, model-state bytes per rank (parameters + gradients + optimizer states this rank holds
before an optimizer step), peak resident memory per rank (ru_maxrss, which includes the interpreter and
libraries), and each figure as a ratio to the first strategy listed. With several ``--optimizers`` (the reference
model's ``optimizer``: docs/optimizers.md) every strategy runs with each, named ``strategy/optimizer``; the model
states then count each optimizer's own state (torchao's quantised codes, scales and code books as stored).
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

from lightning_par.models.lightning_module import OPTIMIZERS

STRATEGIES = ("lightning_ddp", "data_parallel", "zero1", "zero2", "zero3", "tensor_parallel", "context_parallel",
              "expert_parallel", "pipeline_parallel", "hybrid3d")


def worker(strategy_name: str, args: argparse.Namespace) -> None:
    from lightning_par.optim import state_bytes

    import lightning
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import lightning_par  # registers the strategy names
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM

    def local_bytes(tensor) -> int:
        if tensor is None:
            return 0
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return tensor.numel() * tensor.element_size()

    torch.set_num_threads(1)

    class StepTimer(lightning.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._start)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step != 1:  # counted once, in an untimed step (optimizer states exist from step 1 on):
                return  # reading every DTensor's local shard each step would add to the timed step of sharded runs
            inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
            params = list(pl_module.parameters())
            self.state_bytes = sum(local_bytes(p) + local_bytes(p.grad) for p in params) + state_bytes(inner)

        def on_train_end(self, trainer, pl_module):
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
            result = {"step_times": self.times[args.warmup:], "peak_rss_mib": peak_mib,
                      "state_mib": self.state_bytes / 2**20,
                      "tokens_per_step": replicas * args.batch_size * args.seq_len}
            Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(result))

    strategy = DDPStrategy() if strategy_name == "lightning_ddp" else strategy_name
    if strategy_name == "expert_parallel":  # experts split over every process
        strategy = lightning_par.ExpertParallelStrategy(expert_parallel_size=args.devices)
    if strategy_name == "pipeline_parallel":  # one stage per process
        strategy = lightning_par.PipelineParallelStrategy(pipeline_parallel_size=args.devices,
                                                          microbatches=args.microbatches)
    if strategy_name == "zero3":
        strategy = lightning_par.ZeroStrategy(zero_stage=3, keep_gathered_blocks=args.keep_gathered_blocks,
                                              prefetch_blocks=args.prefetch_blocks,
                                              blocks_per_unit=args.blocks_per_unit)
    if strategy_name == "hybrid3d":  # the remaining ranks data parallel
        strategy = lightning_par.Hybrid3DStrategy(tensor_parallel_size=args.hybrid_tp,
                                                  pipeline_parallel_size=args.hybrid_pp,
                                                  sequence_parallel=args.hybrid_tp > 1, microbatches=args.microbatches)
    torch.manual_seed(0)
    model = LlamaLM(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, max_seq_len=args.seq_len,
                    moe_experts=args.moe_experts, optimizer=args.optimizer)
    data = TokenDataModule(source="synthetic", seq_len=args.seq_len, batch_size=args.batch_size, num_samples=8192)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                                callbacks=[StepTimer()], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)


def run_one(name: str, args: argparse.Namespace, out: str) -> dict:
    strategy_name, _, optimizer = name.partition("/")
    shared = {k: v for k, v in vars(args).items() if k not in ("worker", "out", "strategies", "optimizers", "optimizer")}
    command = [sys.executable, os.path.abspath(__file__), "--worker", strategy_name, "--out", out,
               f"--optimizer={optimizer or args.optimizers[0]}",
               *(f"--{k.replace('_', '-')}={v}" for k, v in shared.items())]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.devices)]
    slowest = [max(step) for step in zip(*(r["step_times"] for r in ranks))]
    return {"step_times": slowest, "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "state_mib": max(r["state_mib"] for r in ranks), "tokens_per_step": ranks[0]["tokens_per_step"]}


def _auto_or_int(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--moe-experts", type=int, default=0, help="experts per block (0: dense model)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per batch")
    parser.add_argument("--keep-gathered-blocks", type=_auto_or_int, default="auto",
                        help="zero3: last blocks kept gathered (default auto: the strategy chooses)")
    parser.add_argument("--prefetch-blocks", type=_auto_or_int, default="auto",
                        help="zero3: blocks gathered ahead (default auto: the strategy chooses)")
    parser.add_argument("--blocks-per-unit", type=_auto_or_int, default="auto",
                        help="zero3: blocks gathered and reduced together (default auto: the strategy chooses)")
    parser.add_argument("--hybrid-tp", type=int, default=2, help="hybrid3d: tensor-parallel size")
    parser.add_argument("--hybrid-pp", type=int, default=2, help="hybrid3d: pipeline-parallel size")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=["lightning_ddp", "data_parallel"])
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=["adamw"])
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help=argparse.SUPPRESS)  # a worker's
    parser.add_argument("--worker", choices=STRATEGIES)
    parser.add_argument("--out")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args.worker, args)
        return

    names = [f"{strategy}/{optimizer}" if len(args.optimizers) > 1 else strategy
             for strategy in args.strategies for optimizer in args.optimizers]
    samples: dict[str, list[float]] = {name: [] for name in names}
    memory: dict[str, float] = {name: 0.0 for name in names}
    state: dict[str, float] = {name: 0.0 for name in names}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                result = run_one(name, args, f"{tmp}/{name.replace('/', '-')}{round_index}")
                samples[name] += result["step_times"]
                memory[name] = max(memory[name], result["peak_rss_mib"])
                state[name] = max(state[name], result["state_mib"])
                tokens[name] = result["tokens_per_step"]
    median = {name: statistics.median(times) for name, times in samples.items()}
    base = names[0]
    print(f"world size {args.devices}, {args.rounds} rounds x {args.steps - args.warmup} timed steps, "
          f"dim={args.dim} layers={args.layers} seq={args.seq_len} batch/rank={args.batch_size}; ratios to {base}")
    throughput = {name: tokens[name] / median[name] for name in names}
    print(f"{'strategy':<18}{'step (ms)':>10}{'ratio':>7}{'tokens/s':>10}{'ratio':>7}{'model states/rank (MiB)':>25}"
          f"{'ratio':>7}{'peak RSS/rank (MiB)':>21}{'ratio':>7}")
    for name in names:
        print(f"{name:<18}{median[name] * 1e3:>10.1f}{median[name] / median[base]:>7.2f}{throughput[name]:>10.0f}"
              f"{throughput[name] / throughput[base]:>7.2f}{state[name]:>25.1f}{state[name] / state[base]:>7.2f}"
              f"{memory[name]:>21.0f}{memory[name] / memory[base]:>7.2f}")


if __name__ == "__main__":
    main()
