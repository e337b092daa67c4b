"""``lightning-par verify``: proof that a config's layout trains what one process trains, on the user's own model and
data, at a size this machine holds.

    lightning-par verify --config RUN.yaml [--steps 20] [--world-size N] [--tolerance 1e-5] [fit options]

Two runs of ``--steps`` optimizer steps from the config's seed:

- the layout run is ``lightning-par fit`` itself, on ``N`` CPU processes (default: the config's ``devices`` x
  ``num_nodes``), with :class:`~lightning_par.callbacks.StepRecord` as its only callback (no logger, checkpoint,
  validation or export: nothing the user wrote is touched);
- the reference is Lightning's own single-device loop in this process, with the config's model, optimizer, schedule,
  accumulation, clipping and precision, fed the global batches it draws itself from the config's data module: the
  data module read at world size 1, its order dealt to the layout run's data-parallel replicas as Lightning's
  ``DistributedSampler`` deals it (:mod:`lightning_par.data.drawn`), each step's replica batches joined; streamed
  token shards read without shuffling, from the shard files themselves in their documented order, by code that
  shares nothing with the loader (:mod:`lightning_par.data.shard_windows`).

Each step's samples, loss, whole-model gradient norm and weights are compared. PASS when the layout run trained on
the samples one process drew and all figures stay within ``--tolerance`` (relative; 1e-5 holds in fp32 on CPU), else
the first step where the runs part, and why: the data (replicas that read the same samples, or other samples than
one process draws), or the parameter that differs most. The samples of streamed token shards are also checked
against the shard files whatever their order (:mod:`lightning_par.data.share_check`: each a window of the files,
none read more often in an epoch than the files hold it), which is what stands for the order where it is litdata's
own (shuffled, loader workers, a mixture). A model too large for this machine is shrunk with fit options
(``--model.init_args.n_layers=2``); the report names every option given on top of the config. Exits 1 when the runs
part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from lightning_par.cli.lightning_cli import quiet_lightning
from lightning_par.data.drawn import OneProcessData, join_batches, samples_of, streamed_training_of
from lightning_par.data.shard_windows import ShardWindows, StreamedTraining
from lightning_par.data.share_check import WindowIndex, first_misread
from lightning_par.health.failure_text import VERBOSE_HINT

__all__ = ["Comparison", "Run", "VerifyCommand", "compare", "format_comparison", "main", "read_command",
           "read_layout_run", "record_callback", "reference_run"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-par verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (default 20)")
    parser.add_argument("--world-size", type=int, help="CPU processes of the layout run (default: the config's "
                        "devices x num_nodes)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative difference that passes")
    parser.add_argument("--json", type=Path, help="also write the per-step comparison here")
    return parser


@dataclass
class Run:
    """What a run trained: one global batch per micro-batch, the loss of each, one gradient norm per optimizer step
    and the whole model's weights before the first step and after each; ``replicas``: its data-parallel replicas,
    ``same_samples``: the first micro-batch and two replicas that read the same samples in it, if any; ``epochs``:
    each micro-batch's epoch; ``streamed``: how the data module streams token shards, if it does (the reference's:
    what the layout's samples are checked against)."""

    batches: list[Any]
    losses: list[float]
    gradient_norms: list[float]
    weights: list[dict[str, Tensor]]
    accumulate: int
    layout: str
    replicas: int = 1
    same_samples: tuple[int, int, int] | None = None
    epochs: list[int] = field(default_factory=list)
    streamed: StreamedTraining | None = None


@dataclass
class Comparison:
    """Per optimizer step (1 = after the first): the two runs' losses and gradient norms, and the largest relative
    weight difference with its parameter (step 0: the initial weights)."""

    rows: list[dict[str, Any]]
    tolerance: float
    parted_at: int | None  # the first step beyond the tolerance, None when every step is within it
    reason: str  # why the runs part there, or the worst figures of a pass

    @property
    def passed(self) -> bool:
        return self.parted_at is None


def read_layout_run(folder: Path) -> Run:
    """The layout run from its ranks' records: each micro-batch's global batch is the batches of the data-parallel
    replicas joined in replica order (the first rank of each), its loss the mean over the ranks."""
    records = [torch.load(path, weights_only=False) for path in sorted(folder.glob("rank*.pt"))]
    first_of_replica: dict[int, dict] = {}
    for record in records:
        first_of_replica.setdefault(record["replica"], record)
    replicas = [first_of_replica[index] for index in sorted(first_of_replica)]
    microbatches = range(len(replicas[0]["batches"]))
    batches = [join_batches([replica["batches"][m] for replica in replicas]) for m in microbatches]
    losses = torch.tensor([record["losses"] for record in records], dtype=torch.float64).mean(0).tolist()
    rank0 = next(record for record in records if record["weights"] and record["weights"][0])
    same = next(((m, a, b) for m in microbatches for a in range(len(replicas)) for b in range(a + 1, len(replicas))
                 if samples_of(replicas[a]["batches"][m]) == samples_of(replicas[b]["batches"][m])), None)
    return Run(batches, losses, rank0["gradient_norms"], rank0["weights"], rank0["accumulate"], rank0["layout"],
               len(replicas), same, replicas[0]["epochs"])


def _data_parted(layout: Run, reference: Run) -> tuple[int, str] | None:
    """The first optimizer step whose global batches hold other samples in the two runs, or (streamed token shards)
    samples that are no share of the shard files, and why."""
    sources = reference.streamed.windows() if reference.streamed is not None else None
    if sources is not None:
        misread = first_misread([batch.numpy() for batch in layout.batches], layout.epochs, layout.replicas,
                                reference.accumulate, sources)
        if misread is not None:
            return misread[0] // reference.accumulate + 1, misread[1]
    for m, (trained, drawn) in enumerate(zip(layout.batches, reference.batches)):
        trained_samples, drawn_samples = samples_of(trained), samples_of(drawn)
        if trained_samples == drawn_samples:
            continue
        step = m // reference.accumulate + 1
        if sources is not None and reference.streamed.in_documented_order:
            return step, _out_of_order(trained, drawn, layout.replicas, step, sources)
        if layout.same_samples is not None and layout.same_samples[0] <= m:
            _, a, b = layout.same_samples
            return step, (f"data-parallel replicas {a} and {b} read the same samples (the data module does not split "
                          "its data between the replicas: give each its share, as the DistributedSampler that "
                          "Lightning puts in a map-style loader does, or read num_replicas and rank of "
                          "trainer.strategy.distributed_sampler_kwargs)")
        common = sum((trained_samples & drawn_samples).values())
        return step, (f"the layout run trained on other samples than one process draws from the data module: "
                      f"{common} of the {sum(drawn_samples.values())} samples of micro-batch {m} are the same "
                      f"(lightning_par.data.drawn says how the reference draws them)")
    return None


def _out_of_order(trained: Tensor, drawn: Tensor, replicas: int, step: int,
                  sources: dict[str, ShardWindows]) -> str:
    """The first replica whose samples differ from the documented order's, the windows it read and those the order
    gives it (every sample is a window of the files: checked before)."""
    per_replica = len(drawn) // replicas
    blocks = [slice(replica * per_replica, (replica + 1) * per_replica) for replica in range(replicas)]
    blocks[-1] = slice(blocks[-1].start, None)  # a layout batch longer than the order's differs in its last block
    replica = next(r for r, rows in enumerate(blocks) if samples_of(trained[rows]) != samples_of(drawn[rows]))
    index = WindowIndex(sources, [*trained.numpy(), *drawn.numpy()])
    read, given = ([index.places_of(row)[0][1] for row in batch[blocks[replica]].numpy()] for batch in (trained, drawn))
    return (f"replica {replica} read at step {step} windows {read} of the shard files where their documented order "
            f"gives it windows {given} (docs/data.md, 'Shares')")


def compare(layout: Run, reference: Run, tolerance: float) -> Comparison:
    """Hold ``layout`` to ``reference`` step by step (see the module docstring)."""
    steps = len(reference.gradient_norms)
    if len(layout.gradient_norms) != steps or len(layout.weights) != len(reference.weights):
        return Comparison([], tolerance, 1, f"the layout run took {len(layout.gradient_norms)} optimizer steps, "
                          f"one process {steps}")
    rows: list[dict[str, Any]] = []
    parted_at, reason = _data_parted(layout, reference) or (None, "")
    for step in range(steps + 1):
        worst, parameter = _weights_error(layout.weights[step], reference.weights[step])
        row: dict[str, Any] = {"step": step, "weights_error": worst, "parameter": parameter}
        errors = {"weights": worst}
        if step > 0:
            window = slice((step - 1) * reference.accumulate, step * reference.accumulate)
            row["loss"] = (_mean(layout.losses[window]), _mean(reference.losses[window]))
            row["gradient_norm"] = (layout.gradient_norms[step - 1], reference.gradient_norms[step - 1])
            errors = {"loss": _relative(*row["loss"]), "gradient norm": _relative(*row["gradient_norm"]), **errors}
            row["loss_error"], row["gradient_norm_error"] = errors["loss"], errors["gradient norm"]
        rows.append(row)
        beyond = [name for name, error in errors.items() if not error <= tolerance]
        if beyond and parted_at is None:
            parted_at = step
            if step == 0:
                reason = (f"the runs start from different weights: {parameter} differs by {worst:.1e} relative (the "
                          "model's initial weights do not follow the seed alike in both runs)")
            else:
                reason = "; ".join(f"{parameter if name == 'weights' else name} differs by {errors[name]:.1e} "
                                   "relative" for name in beyond)
                if "weights" not in beyond:
                    reason += f" (of the weights, {parameter} differs most: {worst:.1e})"
    if parted_at is None:
        reason = ", ".join(f"{label} {max(row.get(key, 0.0) for row in rows):.1e}" for label, key in
                           (("loss", "loss_error"), ("gradient norm", "gradient_norm_error"),
                            ("weights", "weights_error")))
    return Comparison(rows, tolerance, parted_at, reason)


def format_comparison(comparison: Comparison, header: str) -> str:
    """``header``, a row per step (the two runs' loss and gradient norm, the weights' difference) and the verdict."""
    lines = [header, f"{'step':>4} {'loss':>12} {'one process':>12} {'rel':>8} {'grad norm':>12} {'one process':>12} "
             f"{'rel':>8} {'weights rel':>11}  parameter differing most"]
    for row in comparison.rows:
        if "loss" in row:
            figures = (f"{row['loss'][0]:>12.6f} {row['loss'][1]:>12.6f} {row['loss_error']:>8.1e} "
                       f"{row['gradient_norm'][0]:>12.6f} {row['gradient_norm'][1]:>12.6f} "
                       f"{row['gradient_norm_error']:>8.1e}")
        else:
            figures = f"{'(initial weights)':>70}"
        lines.append(f"{row['step']:>4} {figures} {row['weights_error']:>11.1e}  {row['parameter']}")
    if comparison.passed:
        lines.append(f"PASS: every step within {comparison.tolerance:.0e} relative (largest: {comparison.reason})")
    else:
        lines.append(f"FAIL at step {comparison.parted_at}: {comparison.reason}")
    return "\n".join(lines)


@dataclass
class VerifyCommand:
    """A ``lightning-par verify`` command line, read and checked: nothing has run yet."""

    options: argparse.Namespace
    cli_args: list[str]  # the config's options (``lightning-par fit``'s)
    seed: int
    world_size: int

    @property
    def given(self) -> list[str]:
        """The options given on top of the config (a shrunk model's, say)."""
        args = self.cli_args
        return [arg for index, arg in enumerate(args) if arg != "--config" and not arg.startswith("--config=")
                and (index == 0 or args[index - 1] != "--config")]


def read_command(argv: list[str]) -> VerifyCommand:
    """``argv`` (after ``verify``) read and checked: the config parses, its model fits this machine."""
    options, cli_args = _parser().parse_known_args(argv)
    if options.steps < 1:
        raise ValueError(f"--steps {options.steps} is not a number of optimizer steps; fit: 1 or more")
    with quiet_lightning():
        seed, world_size = _seed_and_world_size(cli_args, options.world_size)
        _check_it_fits(cli_args, world_size)
    return VerifyCommand(options, cli_args, seed, world_size)


def main(argv: list[str]) -> None:
    """``lightning-par verify`` with ``argv`` (after ``verify``)."""
    command = read_command(argv)
    options, cli_args, seed, world_size, given = (command.options, command.cli_args, command.seed,
                                                  command.world_size, command.given)
    with tempfile.TemporaryDirectory(prefix="lightning-par-verify-") as folder:
        with _phase(f"the layout run: {world_size} processes, {options.steps} steps"):
            layout = _layout_run(cli_args, seed, world_size, options.steps, Path(folder) / "layout")
        with _phase(f"one process on the same global batches, {options.steps} steps"):
            reference = reference_run(cli_args, seed, options.steps, layout.replicas, Path(folder) / "reference")
    comparison = compare(layout, reference, options.tolerance)
    header = (f"lightning-par verify: {layout.layout} on {world_size} CPU processes against one process, "
              f"{options.steps} steps from seed {seed}, on global batches it draws from the data module"
              + (f"; options on top of the config: {' '.join(given)}" if given else ""))
    print(format_comparison(comparison, header))
    if options.json is not None:
        options.json.write_text(json.dumps({"passed": comparison.passed, "parted_at": comparison.parted_at,
                                            "reason": comparison.reason, "rows": comparison.rows}, indent=1))
    if not comparison.passed:
        raise SystemExit(1)


# The trainer of both runs: no logger, checkpoint, validation or progress bar, and what Lightning writes (the config
# it saves) in ``folder``: nothing the user wrote is touched.
def _quiet_trainer(steps: int, folder: Path) -> list[str]:
    return [f"--trainer.default_root_dir={folder}", f"--trainer.max_steps={steps}", "--trainer.max_epochs=-1", "--trainer.accelerator=cpu",
            "--trainer.num_nodes=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            *(f"--monitor.{part}=false" for part in ("throughput", "memory", "communication", "pipeline_bubble",
                                                     "gradient_norm", "layout"))]


def record_callback(folder: Path, *, append: bool = False) -> str:
    """The fit option that makes a run record what it trained in ``folder`` (:class:`~lightning_par.callbacks.
    StepRecord`): as its only callback, or (``append``) beside the config's."""
    record = {"class_path": "lightning_par.callbacks.StepRecord", "init_args": {"folder": str(folder)}}
    return f"--trainer.callbacks+={json.dumps(record)}" if append else f"--trainer.callbacks={json.dumps([record])}"


def _seed_and_world_size(cli_args: list[str], world_size: int | None) -> tuple[int, int]:
    """The config's seed (0 when it draws one) and the layout run's processes."""
    from lightning_par.cli.lightning_cli import ParallelCLI, Parser

    class _Parsed(ParallelCLI):
        def instantiate_classes(self) -> None:  # only the values are read
            pass

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        config = _Parsed(args=cli_args, run=False, parser_class=Parser).config
    seed = config.get("seed_everything")
    seed = 0 if seed is None or isinstance(seed, bool) else int(seed)
    if world_size is None:
        devices, nodes = config["trainer"].get("devices"), config["trainer"].get("num_nodes") or 1
        if not isinstance(devices, int) and not str(devices).isdigit():
            raise ValueError(f"trainer.devices={devices!r} is not a number of processes; give --world-size")
        world_size = int(devices) * int(nodes)
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} is not a number of processes; fit: 1 or more")
    return seed, world_size


def _check_it_fits(cli_args: list[str], world_size: int) -> None:
    """Refuse a model whose weights, gradients and Adam states (16 bytes a parameter) would not fit this machine's
    memory once in each of the ``world_size`` layout processes and once in the reference, naming the way to shrink
    it."""
    from lightning_par.cli.dry_run_rank import read_config

    model = read_config(cli_args, model_contract=False).model  # on the meta device
    parameters = sum(p.numel() for p in model.parameters())
    needed, available = 16 * parameters * (world_size + 1), _available_memory()
    if available is not None and needed > 0.8 * available:
        raise ValueError(
            f"{type(model).__name__} has {parameters / 1e9:.2f}B parameters: {world_size} layout processes and one "
            f"reference would need about {needed / 2 ** 30:.0f} GiB, this machine has {available / 2 ** 30:.0f} GiB "
            "available; shrink the model with fit options (fewer blocks, narrower: e.g. --model.init_args.n_layers=2 "
            "--model.init_args.dim=256), which the report names")


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _layout_run(cli_args: list[str], seed: int, world_size: int, steps: int, folder: Path) -> Run:
    command = [sys.executable, "-m", "lightning_par.cli", "fit", *cli_args, *_quiet_trainer(steps, folder),
               f"--trainer.devices={world_size}", f"--seed_everything={seed}", "--ckpt_path=null",
               record_callback(folder)]
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**_environment_of_this_machine(), "PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        raise RuntimeError(f"the layout run failed: {_first_failure(result.stderr)}")
    return read_layout_run(folder)


def _first_failure(stderr: str) -> str:
    """The run's failure as the command said it: its one line (a refusal, or the fault monitor's report of a failed
    collective), else stderr's last line."""
    lines = [line for line in stderr.splitlines() if line.strip() and line != VERBOSE_HINT]
    said = next((line for line in lines if line.startswith("lightning-par: ")), None)
    return (said or (lines or ["no message"])[-1]).removeprefix("lightning-par: ").removeprefix("error: ")


# What makes Lightning join a launched or scheduled run instead of starting its own processes: a launcher's variables
# (Lightning's own launcher leaves them in the process that launched), SLURM's, LSF's, MPI's.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
_LAUNCH_PREFIXES = ("SLURM_", "LSB_", "OMPI_COMM_WORLD_", "PMI_")


def _environment_of_this_machine() -> dict[str, str]:
    """This process's environment without what would make a run join another's: both runs are this machine's."""
    return {name: value for name, value in os.environ.items()
            if name not in _LAUNCH_VARIABLES and not name.startswith(_LAUNCH_PREFIXES)}


@contextmanager
def _on_this_machine() -> Iterator[None]:
    """:func:`_environment_of_this_machine` as this process's environment while the reference runs."""
    saved, kept = dict(os.environ), _environment_of_this_machine()  # read before the clear below empties it
    os.environ.clear()
    os.environ.update(kept)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _phase(what: str) -> Iterator[None]:
    """Say on stderr what verify is running, then how long it took: each run takes a minute or more."""
    print(f"lightning-par verify: {what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"lightning-par verify: {what}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def reference_run(cli_args: list[str], seed: int, steps: int, replicas: int, folder: Path) -> Run:
    """Lightning's single-device loop with the config's model and trainer, over the global batches of ``replicas``
    data-parallel replicas that this process draws from the config's data module."""
    from lightning_par.cli.lightning_cli import ParallelCLI, Parser

    with warnings.catch_warnings(), quiet_lightning(), _on_this_machine():
        warnings.filterwarnings("ignore")
        cli = ParallelCLI(args=[*cli_args, *_quiet_trainer(steps, folder), "--trainer.strategy=auto",
                                "--trainer.devices=1", f"--seed_everything={seed}", record_callback(folder)],
                          run=False, parser_class=Parser)
        data = OneProcessData(cli.datamodule, replicas, seed)
        if callable(getattr(cli.model, "load_pretrained", None)):
            _load_pretrained(cli.model, data)
        cli.trainer.fit(cli.model, datamodule=data)
    record = torch.load(folder / "rank0.pt", weights_only=False)
    return Run(record["batches"], record["losses"], record["gradient_norms"], record["weights"], record["accumulate"],
               record["layout"], epochs=record["epochs"], streamed=streamed_training_of(cli.datamodule))


def _load_pretrained(module: Any, data: Any) -> None:
    """Build and load a model that a lightning_par strategy builds on the meta device and reads its pretrained weights
    into once the layout is applied (``HFCausalLM``; docs/finetuning.md): Lightning's single-device strategy would
    move it to the device still empty. What the two read of a trainer before its run: each other (the data takes the
    model's tokenizer, the model the data's packing separator), and no checkpoint."""
    data.trainer = module._trainer = SimpleNamespace(datamodule=data, lightning_module=module, ckpt_path=None)
    try:
        data.prepare_data()
        data.setup("fit")
        module.configure_model()
        module.load_pretrained()
    finally:
        data.trainer = module._trainer = None


def _weights_error(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> tuple[float, str]:
    """The largest difference between two state dicts, tensor by tensor as the 2-norm of the difference over the
    expected tensor's 2-norm (at least a millionth of the largest tensor's: one that starts at zero is held to the
    model's scale), and its name.

    A norm, not the largest element: an adaptive optimizer (Adam) divides each element's step by that element's
    gradient size, so an element whose gradient is near zero moves by rounding, by up to a whole step either way;
    such elements are few, and a norm weighs them by their share. A wrong gradient moves every element."""
    if actual.keys() != expected.keys():
        differing = sorted(actual.keys() ^ expected.keys())
        return float("inf"), f"parameters held by one run only: {', '.join(differing[:4])}"
    norms = {key: float(torch.linalg.vector_norm(tensor.double())) for key, tensor in expected.items()
             if tensor.is_floating_point()}
    floor = 1e-6 * max(norms.values(), default=0.0)
    worst, name = 0.0, "-"
    for key, norm in norms.items():
        expected_tensor = expected[key].double()
        difference = float(torch.linalg.vector_norm(actual[key].double() - expected_tensor))
        error = difference / max(norm, floor, 1e-30)
        if error > worst or name == "-":
            worst, name = error, key
    return worst, name


def _relative(actual: float, expected: float) -> float:
    return abs(actual - expected) / max(abs(expected), 1e-12)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
