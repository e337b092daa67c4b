"""Draw the TensorBoard scalars of a run as a grid of small line charts, one per tag against the step (matplotlib).

    pip install -e ".[docs]"
    python docs/plot_scalars.py lightning_logs/hybrid3d/version_0 docs/img/monitoring.png

Reads every scalar whose tag starts with one of the monitoring prefixes (perf/, memory/, comm/, pipeline/,
train/, moe/; docs/monitoring.md says what each means).
"""

from __future__ import annotations

import argparse
from pathlib import Path

PREFIXES = ("perf/", "memory/", "comm/", "pipeline/", "train/", "moe/")
COLUMNS = 4


def read_scalars(run: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every monitoring scalar of the TensorBoard run directory ``run``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in sorted(events.Tags()["scalars"]) if tag.startswith(PREFIXES)}


def draw_scalars(scalars: dict[str, list[tuple[int, float]]], output: str | Path) -> None:
    """One line chart per tag of ``scalars``, ``COLUMNS`` to a row, written to ``output`` (PNG, SVG or PDF)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = (len(scalars) + COLUMNS - 1) // COLUMNS
    figure, axes = plt.subplots(rows, COLUMNS, figsize=(3.2 * COLUMNS, 2.2 * rows), squeeze=False)
    for ax, (tag, points) in zip(axes.flat, scalars.items()):
        ax.plot([step for step, _ in points], [value for _, value in points], linewidth=1.2)
        ax.set_title(tag, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("step", fontsize=7)
    for ax in axes.flat[len(scalars):]:
        ax.set_visible(False)
    figure.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a TensorBoard run directory (holding events.out.tfevents.*)")
    parser.add_argument("output", help="the image to write (.png, .svg or .pdf)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    scalars = read_scalars(args.run)
    if not scalars:
        raise SystemExit(f"no monitoring scalars ({', '.join(PREFIXES)}) in {args.run}")
    draw_scalars(scalars, args.output)
    print(f"wrote {len(scalars)} charts to {args.output}")


if __name__ == "__main__":
    main()
