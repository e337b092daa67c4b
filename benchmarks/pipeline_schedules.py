"""Pipeline schedules side by side: throughput of GPipe, 1F1B, interleaved 1F1B and ZB-V at pp=2 and pp=4.

    python benchmarks/pipeline_schedules.py [--pp 2 4] [--steps 20] [--microbatches 8] [--layers 8] [--rounds 1]
    python benchmarks/pipeline_schedules.py --pp 2 --schedules 1f1b zbv_torch_split zbv --rounds 3 --profile
    python benchmarks/pipeline_schedules.py --pp 2 --backward-split
    python benchmarks/pipeline_schedules.py --pp 2 4 --orders orders.json

Each (pp, schedule) trains the reference Llama model with ``pipeline_parallel`` on ``pp`` CPU processes
(gloo) for ``--steps`` optimizer steps, the same global batch for all; the first ``--warmup`` steps are
not timed. Reported: median step time of the slowest rank, tokens per second, and each as a ratio to the
first schedule listed (GPipe by default) at the same pp; the pipeline bubble as the strategy measures it (``BubbleMeter``: median over the
timed steps of the slowest rank's idle share, transfers and load included) beside the bubble the schedule's
recorded order of actions implies with equal costs (``simulated_bubble``, what the tests assert). On a
2-core machine more processes than cores share the CPU, so compare schedules within one pp rather than
across pp. ``--rounds`` runs the schedules that many times in turn (alternating, so a change in the machine's load
hits all of them) and pools the timed steps.

``zbv_torch_split`` is ZB-V with PyTorch's own split of backward into input and weight gradients instead of the
linear layers' deferred weight gradients (``lightning_par/parallel/pipeline/weight_grad.py``). ``--profile`` adds, per rank
and timed step, the compute of each kind of pipeline action (F forward, B whole backward, I input-gradient half,
W weight-gradient half) in thread CPU time, which another process on the same cores does not inflate as much as
wall time, the point-to-point sends and receives (count, MiB) and the time spent waiting for them.
``--backward-split`` times one ZB-V stage's backward in one process instead, the ways of splitting it alternating
(see :func:`backward_split`). ``--orders FILE`` writes what every rank ran in the last step, in order, for
``docs/plot_schedules.py`` to draw. docs/performance.md reads the results.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKED = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
VARIANTS = {"zbv_torch_split": "zbv"}  # benchmarked by name, not by default: a schedule run another way
ACTIONS = ("F", "B", "I", "W")


class ActionProfile:
    """``--profile``: this rank's pipeline actions while :attr:`on` (the timed steps), summed over them.

    Wraps, before any stage exists, the compute methods of PyTorch's pipeline stages (whatever the schedule) and its
    schedules' point-to-point helpers: thread CPU seconds and calls per action kind, sends and receives with their
    bytes, and the wall seconds spent waiting for transfers.
    """

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import schedules, stage

        self.on = False
        self.totals: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        base = stage._PipelineStageBase
        base.forward_one_chunk = self._timed(base.forward_one_chunk, lambda kwargs: "F")
        base.backward_one_chunk = self._timed(base.backward_one_chunk,
                                              lambda kwargs: "B" if kwargs.get("full_backward", True) else "I")
        base.backward_weight_one_chunk = self._timed(base.backward_weight_one_chunk, lambda kwargs: "W")
        schedules._wait_batch_p2p = self._timed(schedules._wait_batch_p2p, lambda kwargs: "wait", wall=True)
        post = schedules._batch_p2p

        def batch_p2p(ops: list, *args, **kwargs):
            for op in ops if self.on else ():
                kind = "send" if op.op is dist.isend else "recv"
                self.calls[kind] += 1
                self.totals[f"{kind} bytes"] += op.tensor.numel() * op.tensor.element_size()
            return post(ops, *args, **kwargs)

        schedules._batch_p2p = batch_p2p

    def _timed(self, method, kind_of, wall: bool = False):
        clock = time.perf_counter if wall else time.thread_time

        @functools.wraps(method)
        def timed(*args, **kwargs):
            if not self.on:
                return method(*args, **kwargs)
            kind, started = kind_of(kwargs), clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals[kind] += clock() - started
                self.calls[kind] += 1

        return timed


def backward_split(args: argparse.Namespace, iterations: int = 40) -> None:
    """``--backward-split``: one ZB-V stage's forward and backward in this process, the ways of splitting backward
    alternating every iteration (so the machine's load hits them alike): the whole backward (1F1B's B), the input
    gradient alone, PyTorch's input/weight split, and the linear layers' deferred weight gradients. Median thread
    CPU ms."""
    import contextlib
    import copy
    import types

    import torch
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    from lightning_par.models.llama import LlamaConfig, Transformer
    from lightning_par.parallel.pipeline.weight_grad import DeferredWeightGradients

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks, micro = max(1, args.layers // (2 * args.pp[0])), args.batch_size // args.microbatches
    network = Transformer(LlamaConfig(dim=args.dim, n_layers=blocks, n_heads=4, n_kv_heads=2,
                                      max_seq_len=args.seq_len))
    cos, sin = network.rope(args.seq_len)
    stages = {"whole": torch.nn.ModuleList(network.layers.values())}
    stages["input"] = stages["torch"] = stages["whole"]
    stages["deferred"] = copy.deepcopy(stages["whole"])
    store = DeferredWeightGradients([types.SimpleNamespace(submod=stages["deferred"], stage_index=1,
                                                           backward_one_chunk=lambda: None)])
    store.stepping = True
    times: dict[str, list[float]] = collections.defaultdict(list)

    @contextlib.contextmanager
    def timed(key: str):
        started = time.thread_time()
        yield
        times[key].append(time.thread_time() - started)

    for _ in range(iterations):
        for way, stage in stages.items():
            x = y = torch.randn(micro, args.seq_len, args.dim, requires_grad=True)
            with timed(f"{way} F"):
                for block in stage:
                    y = block(y, cos, sin)
                y = y.clone()
            grad = torch.randn_like(y)
            if way == "whole":
                with timed("whole B"):
                    stage_backward((y,), (grad,), [x])
            elif way == "input":  # the input gradient alone, for reference: what any split's I must compute
                with timed("input I"):
                    torch.autograd.grad(y, x, grad)
            elif way == "torch":
                with timed("torch I"):
                    _, groups = stage_backward_input([y], [grad], [x], iter(stage.parameters()))
                with timed("torch W"):
                    stage_backward_weight(iter(stage.parameters()), groups)
            else:  # as a stage's backward action does: armed, then the builder hands over the W half
                with timed("deferred I"):
                    store.armed = True
                    stage_backward((y,), (grad,), [x])
                    store.armed = False
                    weight_half = store.builder()
                with timed("deferred W"):
                    weight_half()
    ms = {key: statistics.median(values[5:]) * 1e3 for key, values in times.items()}
    whole = ms["whole B"]
    print(f"one ZB-V stage: {blocks} blocks, micro-batch {micro} x {args.seq_len}, dim {args.dim}, 1 thread; median "
          f"thread CPU ms of {iterations - 5} alternating iterations")
    print(f"  forward {ms['whole F']:.2f} (deferred layers {ms['deferred F']:.2f}); whole backward {whole:.2f}, of "
          f"which the input gradient alone {ms['input I']:.2f}")
    for way, label in (("torch", "PyTorch's split"), ("deferred", "deferred weight gradients")):
        total = ms[f"{way} I"] + ms[f"{way} W"]
        print(f"  {label}: I {ms[f'{way} I']:.2f} + W {ms[f'{way} W']:.2f} = {total:.2f} ({total / whole:.2f}x the "
              "whole backward)")


def worker(args: argparse.Namespace) -> None:
    import lightning
    import torch

    from lightning_par import PipelineParallelStrategy
    from lightning_par.data import TokenDataModule
    from lightning_par.models import LlamaLM

    torch.set_num_threads(1)
    profile = ActionProfile() if args.profile else None
    if args.worker_schedule in VARIANTS:  # zbv_torch_split
        from lightning_par.parallel.pipeline.runner import PipelineRunner

        PipelineRunner.defer_weight_gradients = False

    class StepTimer(lightning.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.bubbles: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if profile is not None:
                profile.on = batch_idx >= args.warmup
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._start)
            self.bubbles.append(trainer.strategy.parallelized.pipeline.bubble_fraction)
            if profile is not None:
                profile.on = False

        def on_train_end(self, trainer, pl_module):
            meter = trainer.strategy.parallelized.pipeline.bubble
            record = {"times": self.times[args.warmup:], "bubbles": self.bubbles[args.warmup:],
                      "actions": meter.actions, "n_stages": meter.n_stages}
            if profile is not None:
                timed = max(1, len(record["times"]))
                record["profile"] = {"seconds": {k: v / timed for k, v in profile.totals.items()},
                                     "calls": {k: v / timed for k, v in profile.calls.items()}}
            Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(record))

    torch.manual_seed(0)
    model = LlamaLM(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, max_seq_len=args.seq_len)
    data = TokenDataModule(source="synthetic", seq_len=args.seq_len, batch_size=args.batch_size, num_samples=4096)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=args.worker_pp,
                                        pipeline_schedule=VARIANTS.get(args.worker_schedule, args.worker_schedule),
                                        microbatches=args.microbatches)
    trainer = lightning.Trainer(accelerator="cpu", devices=args.worker_pp, strategy=strategy, max_steps=args.steps,
                                callbacks=[StepTimer()], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", choices=BENCHMARKED + tuple(VARIANTS), default=list(BENCHMARKED))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--backward-split", action="store_true")
    parser.add_argument("--orders", help="write each schedule's recorded order of actions per rank to this JSON file")
    parser.add_argument("--worker-pp", type=int)
    parser.add_argument("--worker-schedule", choices=BENCHMARKED + tuple(VARIANTS))
    parser.add_argument("--out")
    return parser


def shared_arguments(args: argparse.Namespace) -> list[str]:
    """What every worker is passed of the command line."""
    shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("steps", "warmup", "microbatches", "dim", "layers", "seq_len", "batch_size")]
    return shared + (["--profile"] if args.profile else [])


def worker_command(pp: int, schedule: str, out: str, shared: list[str]) -> list[str]:
    """The command line of one (pp, schedule) run (tests/test_pipeline_weight_grad.py parses it)."""
    return [sys.executable, os.path.abspath(__file__), f"--worker-pp={pp}", f"--worker-schedule={schedule}",
            f"--out={out}", *shared]


def main() -> None:
    from lightning_par.parallel.pipeline.bubble import simulated_bubble

    args = build_parser().parse_args()
    if args.worker_schedule:
        worker(args)
        return
    if args.backward_split:
        backward_split(args)
        return
    shared = shared_arguments(args)
    tokens = args.batch_size * args.seq_len
    first = args.schedules[0]
    print(f"dim={args.dim} layers={args.layers} seq={args.seq_len} batch={args.batch_size} "
          f"microbatches={args.microbatches}, {args.steps - args.warmup} timed steps x {args.rounds} round(s)")
    print(f"{'pp':>3} {'schedule':<18}{'step (ms)':>10}{'tokens/s':>10}{'vs ' + first:>{max(10, len(first) + 4)}}"
          f"{'bubble':>8}{'implied':>9}")
    profiles, orders = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.pp:
            runs: dict[str, list[list[dict]]] = {schedule: [] for schedule in args.schedules}
            for round_ in range(args.rounds):  # alternating: each round runs every schedule once
                for schedule in args.schedules:
                    out = f"{tmp}/{pp}-{schedule}-{round_}"
                    subprocess.run(worker_command(pp, schedule, out, shared), check=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
                    runs[schedule].append([json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(pp)])
            medians: dict[str, float] = {}
            for schedule, rounds in runs.items():
                # Per timed step the slowest rank; pooled over the rounds.
                medians[schedule] = statistics.median(max(step) for ranks in rounds
                                                      for step in zip(*(r["times"] for r in ranks)))
                measured = statistics.median(max(step) for ranks in rounds
                                             for step in zip(*(r["bubbles"] for r in ranks)))
                implied = max(simulated_bubble({rank: [tuple(a) for a in record["actions"]]
                                                for rank, record in enumerate(rounds[-1])},
                                               n_stages=rounds[-1][0]["n_stages"]).values())
                print(f"{pp:>3} {schedule:<18}{medians[schedule] * 1e3:>10.1f}{tokens / medians[schedule]:>10.0f}"
                      f"{medians[first] / medians[schedule]:>{max(10, len(first) + 4)}.2f}{measured:>8.3f}"
                      f"{implied:>9.3f}")
                orders.append({"pp": pp, "schedule": schedule, "n_stages": rounds[-1][0]["n_stages"],
                               "actions": [record["actions"] for record in rounds[-1]]})
                if args.profile:
                    profiles += [(pp, schedule, rank, [ranks[rank]["profile"] for ranks in rounds])
                                 for rank in range(pp)]
    if profiles:
        print_profiles(profiles)
    if args.orders:
        Path(args.orders).write_text(json.dumps(orders))
        print(f"wrote the recorded orders to {args.orders} (draw them: python docs/plot_schedules.py {args.orders} "
              "OUT.png)")


def print_profiles(profiles: list) -> None:
    """The --profile table: per (pp, schedule, rank), the mean over the rounds of each timed step's actions."""
    print("\nper rank and timed step: thread CPU ms of each kind of action (calls); point-to-point sends and receives "
          "(MiB both ways); wall ms waiting for them")
    print(f"{'pp':>3} {'schedule':<18}{'rank':>5}" + "".join(f"{kind + ' ms':>13}" for kind in ACTIONS)
          + f"{'compute':>9}{'sends':>7}{'recvs':>7}{'MiB':>6}{'wait ms':>9}")
    for pp, schedule, rank, rounds in profiles:
        seconds = {k: statistics.mean(r["seconds"].get(k, 0.0) for r in rounds) for k in rounds[0]["seconds"]}
        calls = {k: statistics.mean(r["calls"].get(k, 0.0) for r in rounds) for k in rounds[0]["calls"]}
        cells = "".join(f"{f'{seconds[k] * 1e3:.1f} ({calls[k]:.0f})':>13}" if calls.get(k) else f"{'-':>13}"
                        for k in ACTIONS)
        compute = sum(seconds.get(k, 0.0) for k in ACTIONS) * 1e3
        mib = (seconds.get("send bytes", 0.0) + seconds.get("recv bytes", 0.0)) / 2**20
        print(f"{pp:>3} {schedule:<18}{rank:>5}{cells}{compute:>9.1f}{calls.get('send', 0):>7.0f}"
              f"{calls.get('recv', 0):>7.0f}{mib:>6.1f}{seconds.get('wait', 0.0) * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
