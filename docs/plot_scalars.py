"""Draw TensorBoard scalars of a run as one SVG of small line charts (no plotting library needed).

    python docs/plot_scalars.py lightning_logs/hybrid3d/version_0 docs/img/monitoring.svg

Reads every scalar whose tag starts with one of the monitoring prefixes (perf/, memory/, comm/,
pipeline/, train/, moe/) and draws one chart per tag against the step, in a grid.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PREFIXES = ("perf/", "memory/", "comm/", "pipeline/", "train/", "moe/")
WIDTH, HEIGHT, COLUMNS, PAD = 240, 130, 4, 28


def chart(tag: str, points: list[tuple[int, float]], x: int, y: int) -> str:
    steps, values = [p[0] for p in points], [p[1] for p in points]
    low, high = min(values), max(values)
    span_x, span_y = max(1, max(steps) - min(steps)), (high - low) or abs(high) or 1.0
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    line = " ".join(f"{x + PAD + (s - min(steps)) / span_x * inner_w:.1f},"
                    f"{y + PAD + inner_h - (v - low) / span_y * inner_h:.1f}" for s, v in points)
    return (f'<rect x="{x + PAD}" y="{y + PAD}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#ccc"/>'
            f'<text x="{x + PAD}" y="{y + PAD - 8}" font-size="11">{tag}</text>'
            f'<text x="{x + 2}" y="{y + PAD + 4}" font-size="8">{high:.3g}</text>'
            f'<text x="{x + 2}" y="{y + PAD + inner_h}" font-size="8">{low:.3g}</text>'
            f'<text x="{x + WIDTH - PAD - 20}" y="{y + HEIGHT - PAD + 12}" font-size="8">step {max(steps)}</text>'
            f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a TensorBoard run directory (holding events.out.tfevents.*)")
    parser.add_argument("output", help="the SVG file to write")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    events = EventAccumulator(args.run)
    events.Reload()
    tags = sorted(tag for tag in events.Tags()["scalars"] if tag.startswith(PREFIXES))
    if not tags:
        raise SystemExit(f"no monitoring scalars in {args.run}")
    rows = (len(tags) + COLUMNS - 1) // COLUMNS
    charts = [chart(tag, [(e.step, e.value) for e in events.Scalars(tag)], (i % COLUMNS) * WIDTH,
                    (i // COLUMNS) * HEIGHT) for i, tag in enumerate(tags)]
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{COLUMNS * WIDTH}" height="{rows * HEIGHT}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{"".join(charts)}</svg>')
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(svg)
    print(f"wrote {len(tags)} charts to {args.output}")


if __name__ == "__main__":
    main()
