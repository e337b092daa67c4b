"""How far a plan's pick rests on the constants no measurement or published row fixes.

Two views. :func:`residual_sensitivity` reads the ranked layouts alone: the bubble of ZB-V and DualPipeV is
proportional to :data:`~lightning_par.layout.schedules.ZERO_BUBBLE_RESIDUAL` (derived for equal forward, input- and
weight-gradient passes, which real blocks do not have) and nothing else in a step depends on it, so the residual at
which the best layout of the other kind of schedule overtakes is solved exactly. :func:`cluster_sensitivity` plans
again with each sourced-but-rough cluster figure (NVLink's bus efficiency, the attention kernels' efficiency, the
usable share of device memory) a quarter lower and higher, and reports the pick each time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from lightning_par.layout.schedules import SCHEDULES, ZERO_BUBBLE_RESIDUAL
from lightning_par.planner.cluster import ClusterSpec
from lightning_par.planner.report import layout_name, schedule_name
from lightning_par.planner.search import Candidate

# The cluster figures cited but not measured or fitted (cluster.py's comments), each planned again at these factors.
ROUGH_FIELDS = ("intra_node_bus_efficiency", "attention_efficiency", "usable_memory_fraction")
FACTORS = (0.75, 1.25)


def layout_label(candidate: Candidate) -> str:
    """Sizes, schedule and recomputation, e.g. ``pp16 dp8 cp16-ring tp8+sp+lp zbv m16 (full)``."""
    return f"{layout_name(candidate)} {schedule_name(candidate)} ({candidate.config.activation_checkpointing})"


def _splits_backward(candidate: Candidate) -> bool:
    return candidate.config.pp > 1 and SCHEDULES[candidate.config.pp_schedule].splits_backward


def _break_even(splitting: Candidate, other_seconds: float) -> float:
    """The residual at which ``splitting`` takes ``other_seconds``: its bubble scales with the residual."""
    bubble = splitting.time.bubble
    return ZERO_BUBBLE_RESIDUAL * (1 + (other_seconds - splitting.time.total) / bubble) if bubble > 0 else float("inf")


def residual_sensitivity(candidates: Sequence[Candidate]) -> str | None:
    """One line when the pick hinges on the zero-bubble residual: the pick splits backward and a layout of another
    schedule wins above some residual, or the pick does not and a splitting layout would win below one."""
    if not candidates:
        return None
    best = candidates[0]
    splitting = [c for c in candidates if _splits_backward(c)]
    others = [c for c in candidates if not _splits_backward(c)]
    if not splitting or not others:
        return None
    rival = others[0] if _splits_backward(best) else splitting[0]
    # The residual where the fastest splitting layout and the fastest other one take the same time: the largest of
    # the splitting layouts' own break-evens (below it, at least one of them is faster).
    threshold = max(_break_even(c, others[0].time.total) for c in splitting)
    margin = rival.time.total / best.time.total - 1
    if _splits_backward(best):
        return (f"Sensitivity: {layout_label(best)} wins by {margin:.1%} at ZERO_BUBBLE_RESIDUAL "
                f"{ZERO_BUBBLE_RESIDUAL:.3f} (equal forward, input- and weight-gradient passes); {layout_label(rival)} "
                f"wins above {threshold:.3f}.")
    if threshold <= 0:
        return None
    return (f"Sensitivity: {layout_label(best)} wins by {margin:.1%} over {layout_label(rival)} at "
            f"ZERO_BUBBLE_RESIDUAL {ZERO_BUBBLE_RESIDUAL:.3f}; the latter wins below {threshold:.3f}.")


def cluster_sensitivity(plan: Callable[[ClusterSpec], list[Candidate]], cluster: ClusterSpec,
                        fields: Sequence[str] = ROUGH_FIELDS, factors: Sequence[float] = FACTORS) -> str:
    """A markdown table: the pick and its MFU with each of ``fields`` of ``cluster`` times each factor (capped at 1),
    ``plan`` planning again on the changed cluster."""
    lines = ["| figure | value | pick | MFU |", "|---|---:|---|---:|"]
    baseline = plan(cluster)[0]
    lines.append(f"| as preset | | {layout_label(baseline)} | {baseline.mfu:.1%} |")
    for name in fields:
        value = getattr(cluster, name) if name != "attention_efficiency" else cluster.attention_rate_fraction
        for factor in factors:
            changed = min(1.0, value * factor)
            try:
                best = plan(dataclasses.replace(cluster, **{name: changed}))[0]
                pick, mfu = layout_label(best), f"{best.mfu:.1%}"
            except ValueError:
                pick, mfu = "none fits", "-"
            lines.append(f"| `{name}` | {changed:.3f} | {pick} | {mfu} |")
    return "\n".join(lines)


__all__ = ["FACTORS", "ROUGH_FIELDS", "cluster_sensitivity", "layout_label", "residual_sensitivity"]
