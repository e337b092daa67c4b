"""``lightning-par check``: a dry run of a config's layout at its target world size, on this machine.

    lightning-par check --config RUN.yaml --world-size 512 [--ranks 0,17,511] [--json report.json] [fit options]

Each chosen rank is one process on torch's fake backend that builds the model on the meta device, lays it out with
the config's own strategy (stages, tensor-parallel splits, FSDP2 units, experts) and takes a training step on fake
tensors (``lightning_par.cli.dry_run_rank``). The report gives, per rank, what it holds at the step's peak
(parameters, gradients, optimizer states, activations) and what each mesh dimension moved (collectives and bytes).
Under pipeline parallel a rank's whole pipeline runs, one process per stage, since a stage learns its input's shape
from the stage before it. Without ``--ranks``: rank 0 and, under pipeline parallel, the other stages of its pipeline
(the first and the last stage hold the embedding and the head). Options after the command's own are ``lightning-par
fit``'s (``--data.init_args.seq_len 8192``).
"""

from __future__ import annotations

import argparse
import json
import os
import multiprocessing
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lightning_par.layout.config import ParallelConfig

__all__ = ["CheckCommand", "chosen_ranks", "format_report", "held_model_states", "main", "read_command",
           "run_dry_runs"]

_GIB = 1024 ** 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-par check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the run to check")
    parser.add_argument("--ranks", help="comma-separated ranks to dry-run (default: rank 0's pipeline)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    return parser


def chosen_ranks(given: list[int] | None, world_size: int, pp: int) -> list[int]:
    """The ranks to run: ``given`` (default rank 0), each with the other stages of its pipeline under pp > 1."""
    ranks = given if given else [0]
    wrong = [rank for rank in ranks if not 0 <= rank < world_size]
    if wrong:
        raise ValueError(f"--ranks {','.join(map(str, wrong))} are not ranks of a world of {world_size}; fit: 0 to "
                         f"{world_size - 1}")
    per_stage = world_size // pp  # the pipeline dimension is outermost (docs/architecture.md)
    return sorted({rank % per_stage + stage * per_stage for rank in ranks for stage in range(pp)})


def run_dry_runs(cli_args: list[str], world_size: int, ranks: list[int], pp: int) -> list[dict[str, Any]]:
    """Run the dry runs of ``ranks`` (one process each; a pipeline's stages at once) and return their reports."""
    per_stage = world_size // pp
    pipelines: dict[int, list[int]] = {}
    for rank in ranks:
        pipelines.setdefault(rank % per_stage, []).append(rank)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    reports = []
    # Ranks done of all, the time so far and what is left (a 405B model's 128 ranks take minutes), on a terminal.
    progress = tqdm(total=len(ranks), desc="dry runs", unit="rank", file=sys.stderr, disable=None, leave=False)
    with progress, tempfile.TemporaryDirectory(prefix="lightning-par-check-") as folder:
        for members in pipelines.values():
            processes = {rank: _start(rank, world_size, store.port, Path(folder), cli_args) for rank in members}
            failures = []
            for rank, process in processes.items():
                process.join()
                progress.update()
                if process.exitcode != 0:
                    failures.append((rank, _errors_of(Path(folder) / f"{rank}.stderr")))
                else:
                    reports.append(json.loads((Path(folder) / f"{rank}.json").read_text()))
            if failures:
                rank, stderr = failures[0]
                lines = [line for line in stderr.strip().splitlines() if line.strip()]
                last = re.sub(r"^\[rank\d+\]: ", "", lines[-1]) if lines else "no message"
                also = "" if len(failures) == 1 else f" (ranks {[r for r, _ in failures]} failed)"
                if last.startswith("ValueError: "):  # a refusal: the rank's own message
                    raise ValueError(f"the dry run of rank {rank}: {last.removeprefix('ValueError: ')}{also}")
                raise RuntimeError(f"the dry run of rank {rank} failed: {last}{also}")
    return sorted(reports, key=lambda report: report["rank"])


# What a rank process imports (about 6 s of CPU each): imported once, in the server the rank processes fork from.
_PRELOADED = ["torch", "torch.distributed.tensor", "torch.distributed.pipelining", "lightning.pytorch",
              "lightning_par.strategies", "lightning_par.cli.dry_run_rank", "lightning_par.cli.lightning_cli"]


def _start(rank: int, world_size: int, port: int, folder: Path, cli_args: list[str]) -> Any:
    """Rank ``rank``'s dry run, forked from the server. It measures what a fresh interpreter would: the only thing a
    process's past changes in a step, when Python's cyclic collector runs, is fixed by the measured step itself
    (``lightning_par.dry_run.tracked_step._FixedCollections``)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOADED)  # read when the server starts: at the first rank
    argv = [str(rank), str(world_size), str(port), str(folder / f"{rank}.json"), *cli_args]
    process = context.Process(target=_rank_process, args=(argv, str(folder / f"{rank}.stderr"), dict(os.environ),
                                                          list(sys.path)), daemon=False)
    process.start()
    return process


def _rank_process(argv: list[str], stderr: str, environment: dict[str, str], path: list[str]) -> None:
    """A dry-run rank in a process forked from the server: this command's environment and import path (the server's
    are those of when it started), its output dropped, its errors written to ``stderr`` for the report."""
    import traceback
    import warnings

    from lightning_par.cli.dry_run_rank import run_rank

    os.environ.clear()
    os.environ.update(environment)
    sys.path[:] = path
    warnings.simplefilter("ignore")
    with open(os.devnull, "w") as nothing, open(stderr, "w") as errors:
        os.dup2(nothing.fileno(), 1)
        os.dup2(errors.fileno(), 2)
        try:
            run_rank(argv)
        except BaseException:  # noqa: BLE001 - reported by the command, from the last line of ``stderr``
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)


def _errors_of(stderr: Path) -> str:
    """What a failed rank wrote to ``stderr``; nothing where it died before opening it (the server could not
    start it)."""
    return stderr.read_text() if stderr.exists() else ""


def format_report(reports: list[dict[str, Any]]) -> str:
    """A table of memory per rank (GiB at the step's peak) and one of collectives per rank and dimension."""
    if not reports:
        return "no rank was dry-run"
    first = reports[0]
    lines = [f"Dry run of {first['layout']}, zero_stage={first['zero_stage']}, on {first['world_size']} ranks "
             "(fake backend, fake tensors): memory at the peak of a training step, GiB; the model states a rank holds "
             "once backward made its gradients and its peak beside the planner's (lightning_par.planner.memory)",
             f"{'rank':>6} {'stage':>5} {'params':>10} {'param':>7} {'grad':>7} {'optim':>7} {'activ':>7} "
             f"{'other':>7} {'peak':>7} | {'states':>7} {'planned':>7} | {'peak':>7} {'planned':>7} | {'host GiB':>8} "
             f"{'s':>6}"]
    for report in reports:
        memory = report["memory"]
        other = memory["buffers"] + memory["temporaries"] + memory["other"]
        lines.append(f"{report['rank']:>6} {','.join(map(str, report['stages'])):>5} "
                     f"{report['local_parameters'] / 1e9:>9.3f}B "
                     + " ".join(f"{value / _GIB:>7.2f}" for value in (
                         memory["parameters"], memory["gradients"], memory["optimizer_states"],
                         memory["activations"], other, memory["peak"]))
                     + _versus(report)
                     + f" | {report['host_peak_bytes'] / _GIB:>8.2f} {report['seconds']:>6.1f}")
    lines.append("Collectives of one training step: calls / MiB, by mesh dimension")
    dimensions = sorted({name for report in reports for name in report["collectives"]})
    lines.append(f"{'rank':>6} " + " ".join(f"{name:>16}" for name in dimensions))
    for report in reports:
        cells = []
        for name in dimensions:
            total = report["collectives"].get(name)
            cells.append(f"{total['calls']:>5} / {total['bytes'] / 2 ** 20:>8.1f}" if total else f"{'-':>16}")
        lines.append(f"{report['rank']:>6} " + " ".join(cells))
    lines += _cyclic_notes(reports)
    if int(re.search(r"\btp=(\d+)", first["layout"]).group(1)) > 1:
        lines.append("The tensor-parallel split is applied as the model map gives it, unchecked: lightning-par verify "
                     "proves the layout trains what one process trains.")
    return "\n".join(lines)


def _cyclic_notes(reports: list[dict[str, Any]]) -> list[str]:
    """A line for each rank whose step left tensors to Python's cyclic garbage collector: its peak counts them held
    until the collection that freed them, where a run frees them whenever its collector happens to run."""
    return [f"rank {report['rank']}: {report['cyclic_bytes'] / _GIB:.2f} GiB of the step's tensors were held by "
            "reference cycles and freed only by Python's garbage collector; the peak counts them until the dry run "
            "collected them" for report in reports if report.get("cyclic_bytes")]


def held_model_states(report: dict[str, Any]) -> int:
    """Bytes of parameters, gradients and optimizer states a dry-run rank held once backward made its gradients."""
    return sum(report["states"][kind] for kind in ("parameters", "gradients", "optimizer_states"))


def _versus(report: dict[str, Any]) -> str:
    """Model states and peak, dry run against the planner's memory model (``planned``, when the report has it)."""
    held = held_model_states(report) / _GIB
    planned = report.get("planned")
    if planned is None:
        return f" | {held:>7.2f} {'-':>7} | {report['memory']['peak'] / _GIB:>7.2f} {'-':>7}"
    return (f" | {held:>7.2f} {planned['model_states'] / _GIB:>7.2f} | {report['memory']['peak'] / _GIB:>7.2f} "
            f"{planned['total'] / _GIB:>7.2f}")


@dataclass
class CheckCommand:
    """A ``lightning-par check`` command line, read and checked: nothing has run yet."""

    options: argparse.Namespace
    cli_args: list[str]  # the config's options (``lightning-par fit``'s)
    config: ParallelConfig  # the layout at the target world size
    ranks: list[int]  # the ranks to dry-run
    planned: list[dict[str, float]]  # the planner's memory model per pipeline rank


def read_command(argv: list[str]) -> CheckCommand:
    """``argv`` (after ``check``) read, its config built on the meta device and its layout checked at the world size;
    every refusal is made here, before any rank's process starts."""
    from lightning_par.cli.lightning_cli import quiet_lightning
    from lightning_par.cli.dry_run_rank import layout_of, planned_memory, read_config

    options, cli_args = _parser().parse_known_args(argv)
    if options.world_size < 1:
        raise ValueError(f"--world-size {options.world_size} is not a number of ranks; fit: 1 or more")
    given = None
    if options.ranks:
        try:
            given = [int(text) for text in options.ranks.split(",")]
        except ValueError:
            raise ValueError(f"--ranks {options.ranks!r} is not a comma-separated list of ranks") from None
    with quiet_lightning():
        cli = read_config(cli_args)
        config = layout_of(cli, options.world_size)
        return CheckCommand(options, cli_args, config, chosen_ranks(given, options.world_size, config.pp),
                            planned_memory(cli, config))


def main(argv: list[str]) -> None:
    """``lightning-par check`` with ``argv`` (after ``check``)."""
    command = read_command(argv)
    reports = run_dry_runs(command.cli_args, command.options.world_size, command.ranks, command.config.pp)
    for report in reports:
        report["planned"] = command.planned[report["coordinates"]["pp"]]
    print(format_report(reports))
    if command.options.json is not None:
        command.options.json.write_text(json.dumps(reports, indent=1))
