"""Which pairs of techniques compose in one layout: every pair of the features below, as a ``ParallelConfig``,
through ``check_composable`` (what the strategies and ``parallelize`` ask before any collective).

    python docs/composition_matrix.py            # the table of docs/hybrid3d.md
    python docs/composition_matrix.py --refused  # only the pairs refused, with the reason

Two features that set the same knob to different values (two pipeline schedules, two ZeRO stages) are
alternatives, not a pair, and are left out. ``tests/test_compositions.py`` holds the result to this table.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

#: Each feature as the ``ParallelConfig`` fields that turn it on, at the smallest sizes.
FEATURES: dict[str, dict[str, Any]] = {
    "tp": dict(tp=2),
    "tp+SP": dict(tp=2, sequence_parallel=True),
    "tp+LP": dict(tp=2, loss_parallel=True),
    "pp 1F1B": dict(pp=2, pp_schedule="1f1b"),
    "pp ZB-V": dict(pp=2, pp_schedule="zbv"),
    "pp DualPipeV": dict(pp=2, pp_schedule="dualpipev"),
    "cp Ulysses": dict(cp=2, cp_method="ulysses"),
    "cp ring": dict(cp=2, cp_method="ring"),
    "ep": dict(ep=2),
    "HSDP": dict(dp_replicate=2, zero_stage=3),
    "ZeRO-1": dict(zero_stage=1),
    "ZeRO-2": dict(zero_stage=2),
    "ZeRO-3": dict(zero_stage=3),
    "sharded accumulation": dict(zero_stage=3, sharded_accumulation=True),
    "compile": dict(compile=True),
    "float8": dict(float8="tensorwise"),
    "async TP": dict(tp=2, sequence_parallel=True, compile=True, async_tp=True),
    "CPU offload": dict(zero_stage=3, cpu_offload=True),
    "full recomputation": dict(activation_checkpointing="full"),
}


def pairs() -> list[tuple[str, str, dict[str, Any]]]:
    """Every pair of features whose fields do not contradict each other, with the fields together."""
    found = []
    for first, second in itertools.combinations(FEATURES, 2):
        a, b = FEATURES[first], FEATURES[second]
        if any(a[key] != b[key] for key in a.keys() & b.keys()):
            continue  # alternatives: the same knob set two ways
        found.append((first, second, {**a, **b}))
    return found


def refusal(fields: dict[str, Any]) -> str | None:
    """``check_composable``'s reason for refusing ``fields``, or None where they compose."""
    from lightning_par.config import ParallelConfig

    try:
        ParallelConfig(**fields).check_composable()
    except ValueError as error:
        return str(error)
    return None


def matrix() -> dict[tuple[str, str], str | None]:
    """(feature, feature) -> the reason it is refused, or None; for every pair of :func:`pairs`."""
    return {(first, second): refusal(fields) for first, second, fields in pairs()}


def markdown(results: dict[tuple[str, str], str | None]) -> str:
    """The matrix as a markdown table: one row and one column per feature; ``✓`` composes, ``✗`` is refused,
    ``·`` an alternative (or the feature itself)."""
    names = list(FEATURES)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in names:
        cells = []
        for column in names:
            key = (row, column) if (row, column) in results else (column, row)
            cells.append("·" if key not in results else ("✗" if results[key] else "✓"))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refused", action="store_true", help="only the refused pairs, with the reason")
    args = parser.parse_args(argv)
    results = matrix()
    refused = {pair: reason for pair, reason in results.items() if reason}
    if args.refused:
        for (first, second), reason in refused.items():
            print(f"{first} x {second}: {reason}")
        return
    print(markdown(results))
    print(f"\n{len(results) - len(refused)} of {len(results)} pairs compose, {len(refused)} are refused")


if __name__ == "__main__":
    main()
