"""``lightning-par plan --config RUN.yaml --check [K]``: the planner's first K layouts dry-run, side by side.

Each layout the planner chose is written onto the config's strategy (hybrid3d, which takes every size and knob) and
checked as ``lightning-par check`` checks a config (``lightning_par/cli/check.py``): rank 0's pipeline at the
target world size, on the fake backend, with fake tensors. The report puts each pipeline rank's model states and
peak from the dry run beside the planner's, so a layout whose memory the planner got wrong shows before the cluster
is booked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_par.layout.config import ParallelConfig
from lightning_par.layout.dimensions import strategy_spelling
from lightning_par.planner.report import layout_name
from lightning_par.planner.search import Candidate

__all__ = ["check_candidates", "layout_arguments"]

_HYBRID = "lightning_par.strategies.Hybrid3DStrategy"


def layout_arguments(config: ParallelConfig) -> list[str]:
    """``lightning-par fit`` options that give the config's strategy the layout ``config`` (hybrid3d's names): every
    field that differs from ``ParallelConfig``'s default, the data-parallel size always."""
    default, hybrid = ParallelConfig(), strategy_spelling("dp")
    options = [f"--trainer.strategy={_HYBRID}",
               f"--trainer.strategy.init_args.data_parallel_size={int(config.dp_replicate) * int(config.dp_shard)}"]
    for field in dataclasses.fields(ParallelConfig):
        value = getattr(config, field.name)
        if field.name in ("dp_shard", "spelling") or value == getattr(default, field.name):
            continue
        options.append(f"--trainer.strategy.init_args.{hybrid.name(field.name)}={value}")
    return options


def check_candidates(config_path: Path, candidates: Sequence[Candidate], world_size: int) -> str:
    """Dry-run each of ``candidates`` (rank 0's pipeline) with the model and data of ``config_path``; a table of each
    pipeline rank's model states and peak, dry run beside planner (GiB, or MiB where every peak is under 1 GiB). A
    layout the dry run refuses gets its reason on its row, and the others are still checked."""
    from lightning_par.cli.check import read_command, run_dry_runs

    checked: list[tuple[int, str, list[tuple[dict[str, Any], dict[str, float]]] | str]] = []
    for number, candidate in enumerate(candidates, 1):
        arguments = ["--config", str(config_path), *layout_arguments(candidate.config)]
        try:
            command = read_command(["--world-size", str(world_size), *arguments])
            reports = run_dry_runs(command.cli_args, world_size, command.ranks, command.config.pp)
        except (ValueError, RuntimeError) as error:
            checked.append((number, layout_name(candidate), f"not checked: {error}"))
            continue
        checked.append((number, layout_name(candidate),
                        [(report, command.planned[report["coordinates"]["pp"]]) for report in reports]))
    peaks = [report["memory"]["peak"] for _, _, ranks in checked if isinstance(ranks, list) for report, _ in ranks]
    unit, scale = ("GiB", 2 ** 30) if max(peaks, default=0) >= 2 ** 30 else ("MiB", 2 ** 20)
    lines = [f"Dry runs of the first layouts (lightning-par check: rank 0's pipeline, fake backend, fake tensors), "
             f"{unit} per rank: model states and peak, dry run / planned",
             f"{'#':>2}  {'layout':<28} {'rank':>6} {'stage':>5} | {'states':>8} {'planned':>8} | {'peak':>8} "
             f"{'planned':>8} {'ratio':>6}"]
    for number, name, ranks in checked:
        if isinstance(ranks, str):
            lines.append(f"{number:>2}  {name:<28} {ranks}")
            continue
        for report, planned in ranks:
            lines.append(f"{number:>2}  {name:<28} " + _row(report, planned, scale))
            name = ""
    return "\n".join(lines)


def _row(report: dict[str, Any], planned: dict[str, float], scale: float) -> str:
    from lightning_par.cli.check import held_model_states

    states = held_model_states(report)
    peak = report["memory"]["peak"]
    return (f"{report['rank']:>6} {','.join(map(str, report['stages'])):>5} | {states / scale:>8.2f} "
            f"{planned['model_states'] / scale:>8.2f} | {peak / scale:>8.2f} {planned['total'] / scale:>8.2f} "
            f"{peak / planned['total']:>6.2f}")
