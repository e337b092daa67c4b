"""Draw pipeline schedules as they ran: per rank, which micro-batch's F, B, I or W ran when (matplotlib).

    pip install -e ".[docs]"
    python benchmarks/pipeline_schedules.py --pp 2 4 --orders orders.json
    python docs/plot_schedules.py orders.json docs/img/pipeline_schedules.png

The orders are what each rank's ``BubbleMeter`` recorded in the last training step of a real run
(``lightning_par/parallel/pipeline/bubble.py``). They are placed in time with equal costs (F = I = W = 1,
B = I + W) by ``simulated_timeline``, so the picture shows the schedule, not the machine's load: the white
space is the bubble the schedule implies. Each box is one action, labelled with its micro-batch; a rank's
second (virtual) stage is drawn lighter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#64b5cd", "W": "#dd8452"}
NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def draw_schedules(runs: list[dict[str, Any]], output: str | Path) -> int:
    """One chart per run of ``runs`` (``{"pp", "schedule", "n_stages", "actions": [rank 0's, rank 1's, ...]}``,
    each action ``[stage, kind, micro-batch]``), stacked, written to ``output``. Returns the boxes drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from lightning_par.parallel.pipeline.bubble import simulated_bubble, simulated_timeline

    figure, axes = plt.subplots(len(runs), 1, figsize=(11, 0.5 + 0.42 * sum(r["pp"] for r in runs) + 0.6 * len(runs)),
                                squeeze=False, gridspec_kw={"height_ratios": [r["pp"] for r in runs]})
    boxes = 0
    for ax, run in zip(axes[:, 0], runs):
        orders = {rank: [tuple(action) for action in actions] for rank, actions in enumerate(run["actions"])}
        timeline = simulated_timeline(orders, run["n_stages"])
        bubble = max(simulated_bubble(orders, run["n_stages"]).values())
        for rank, placed in timeline.items():
            first_stage = min((stage for _, _, (stage, _, _) in placed), default=0)
            for start, end, (stage, kind, micro) in placed:
                ax.barh(rank, end - start, left=start, height=0.8, color=COLOURS[kind], edgecolor="white",
                        alpha=1.0 if stage == first_stage else 0.55)
                ax.text((start + end) / 2, rank, str(micro), ha="center", va="center", fontsize=6, color="white")
                boxes += 1
        ax.set_yticks(range(run["pp"]), [f"rank {rank}" for rank in range(run["pp"])], fontsize=7)
        ax.invert_yaxis()
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"pp={run['pp']} {run['schedule']}: {run['n_stages']} stages, bubble {bubble:.3f} of the step",
                     fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("time (one forward = 1)", fontsize=7)
    kinds = sorted({kind for run in runs for actions in run["actions"] for _, kind, _ in actions}, key="FBIW".index)
    figure.legend(handles=[Patch(color=COLOURS[kind], label=f"{kind}: {NAMES[kind]}") for kind in kinds],
                  loc="upper right", fontsize=7, ncol=len(kinds))
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return boxes


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the documented invocations against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("orders", help="the JSON file benchmarks/pipeline_schedules.py --orders wrote")
    parser.add_argument("output", help="the image to write (.png, .svg or .pdf)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    runs = json.loads(Path(args.orders).read_text())
    if not runs:
        raise SystemExit(f"no recorded schedules in {args.orders}")
    draw_schedules(runs, args.output)
    print(f"wrote {len(runs)} schedules to {args.output}")


if __name__ == "__main__":
    main()
