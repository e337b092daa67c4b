"""The published runs as docs/planner.md shows them and ``lightning-par plan --published`` prints them.

Three markdown tables: every run's predicted / published ratio in sample, left out alone and left out with its
source (:func:`lightning_par.planner.refit.hold_out`), with its memory against the device's; the fitted constants
against their value in the code; and every open choice of a run (:class:`~lightning_par.planner.published.OpenChoice`)
costed at each of its options, so that the spread the sources leave is on the page beside the choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_par.planner.cluster import GiB
from lightning_par.planner.published import PUBLISHED_RUNS, PublishedRun
from lightning_par.planner.refit import FITTED, HoldOut, code_values, fit, hold_out, ratio_error

# What the held-out rows must reach: mean and largest |ratio - 1|.
HELD_OUT_BAR = (0.20, 0.35)


def runs_table(runs: Sequence[PublishedRun] = PUBLISHED_RUNS, held: HoldOut | None = None) -> str:
    """Each run with its ratios in sample, leave-one-out and leave-one-source-out, its memory, and the constants
    fitted to it; then the errors of each pass."""
    held = held or hold_out(runs)
    lines = ["| run | source | unit | published | predicted | in sample | leave one out | leave source out | "
             "memory GiB: published / predicted / usable | fits |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for run in runs:
        candidate = run.candidate()
        published = f"{run.memory_gib:.1f}" if run.memory_gib else "-"
        memory = f"{published} / {candidate.memory.total / GiB:.1f} / {candidate.memory_limit / GiB:.1f}"
        fits = ", ".join(f"`{name}`" for name in run.fits) or "held out"
        lines.append(f"| {run.name} | {run.source} | {run.unit} | {run.published:,.0f} | "
                     f"{run.throughput(candidate.time.total):,.0f} | {held.in_sample[run.name]:.2f} | "
                     f"{held.leave_one_out[run.name]:.2f} | {held.leave_source_out[run.name]:.2f} | {memory} | "
                     f"{fits} |")
    lines.append("")
    fitted = [run.name for run in runs if not run.held_out]
    held_out = [run.name for run in runs if run.held_out]
    lines += [f"- in sample, rows a constant was fitted to: {ratio_error(held.in_sample[n] for n in fitted)}",
              f"- leave one out, rows a constant was fitted to: {ratio_error(held.leave_one_out[n] for n in fitted)}",
              f"- leave one out, all rows: {ratio_error(held.leave_one_out.values())}",
              f"- leave one source out, all rows: {ratio_error(held.leave_source_out.values())}"]
    error = ratio_error(held.in_sample[n] for n in held_out)
    verdict = "within" if error.mean <= HELD_OUT_BAR[0] and error.largest <= HELD_OUT_BAR[1] else "NOT within"
    lines.append(f"- held out (no constant fitted to them): {error}; {verdict} the bar of mean "
                 f"{HELD_OUT_BAR[0]:.2f}, largest {HELD_OUT_BAR[1]:.2f}")
    return "\n".join(lines)


def constants_table(runs: Sequence[PublishedRun] = PUBLISHED_RUNS) -> str:
    """Each fitted constant: its value in the code, its fit by :func:`~lightning_par.planner.refit.fit`, the rows
    that set it and the prior it falls back to when they are left out."""
    fitted = fit(runs, start=code_values())
    lines = ["| constant | in the code | fitted | rows | prior without them |", "|---|---:|---:|---|---|"]
    for constant in FITTED:
        rows = "; ".join(run.name for run in runs if constant.name in run.fits)
        lines.append(f"| `{constant.name}` | {constant.value:.3f} | {fitted[constant.name]:.4f} | {rows} | "
                     f"{constant.prior_reason} |")
    return "\n".join(lines)


def choices_table(runs: Sequence[PublishedRun] = PUBLISHED_RUNS) -> str:
    """Every combination of each run's open choices, costed with the code's constants: ratio and memory, the
    chosen one marked; then each run's spread over the combinations that fit."""
    lines = ["| run | options | ratio | memory GiB / usable | fits |", "|---|---|---:|---|---|"]
    spreads = []
    for run in runs:
        if not run.open_choices:
            continue
        settings = [choice.setting for choice in run.open_choices]
        fitting = []
        for labels in itertools.product(*([label for label, _ in choice.options] for choice in run.open_choices)):
            chosen = all(label == choice.chosen for label, choice in zip(labels, run.open_choices))
            variant = run.with_choices(dict(zip(settings, labels)))
            candidate = variant.candidate()
            ratio = variant.ratio()
            if candidate.fits:
                fitting.append(ratio)
            options = ", ".join(f"{setting} {label}" for setting, label in zip(settings, labels))
            lines.append(f"| {run.name} | {options}{' (costed)' if chosen else ''} | {ratio:.2f} | "
                         f"{candidate.memory.total / GiB:.1f} / {candidate.memory_limit / GiB:.1f} | "
                         f"{'yes' if candidate.fits else 'no'} |")
        spreads.append(f"- {run.name}: {min(fitting):.2f} to {max(fitting):.2f} over the {len(fitting)} options "
                       "that fit")
    return "\n".join([*lines, "", *spreads])


def published_report(runs: Sequence[PublishedRun] = PUBLISHED_RUNS) -> str:
    """The three tables, as ``lightning-par plan --published`` prints them."""
    return "\n\n".join([runs_table(runs), constants_table(runs), choices_table(runs)])


__all__ = ["HELD_OUT_BAR", "choices_table", "constants_table", "published_report", "runs_table"]
