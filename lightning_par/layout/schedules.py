"""Pipeline stage arithmetic: how many stages a rank holds, which ones, and how blocks are balanced.

Pure Python (no torch), shared by ``lightning_par.parallel.pipeline``, which cuts the model, and
``lightning_par.planner``, which predicts what each rank will hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]
#: Schedules whose two stages per rank sit in a V: rank r holds stages r and 2p - 1 - r. They are also the ones
#: that split a stage's backward into input- and weight-gradient actions (I and W).
V_SCHEDULES = ("zbv", "dualpipev")


def stages_per_rank(schedule: Schedule, virtual_stages: int) -> int:
    """How many stages each rank holds under ``schedule``."""
    return {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": virtual_stages, "zbv": 2, "dualpipev": 2}[schedule]


def stage_indices(pp_rank: int, pp: int, schedule: Schedule, virtual_stages: int = 2) -> list[int]:
    """The stages rank ``pp_rank`` holds: looped (``r, r + pp, ...``) or V-shaped (``r, 2pp - 1 - r``)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule, virtual_stages))]


def balance(costs: Sequence[float], n_stages: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Numbers of consecutive blocks per stage that minimise the most expensive stage.

    ``costs`` are per block; ``first`` (embedding) and ``last`` (final norm, head, loss) are added to the
    first and the last stage. Exact dynamic programme over the split points, O(n_blocks^2 x n_stages).
    """
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = (float("inf"), float("inf"))
    # best[s][i]: (largest stage cost, sum of squared stage costs) of stages 0..s-1 holding blocks 0..i-1,
    # least first by the largest cost, then by the squares (among equally slow splits, the most even).
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):  # stage s-1 holds blocks j..i-1 (at least one)
                cost = stage_cost(s - 1, j, i)
                value = (max(best[s - 1][j][0], cost), best[s - 1][j][1] + cost * cost)
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    sizes, end = [], n
    for s in range(n_stages, 0, -1):
        start = choice[s][end]
        sizes.append(end - start)
        end = start
    return sizes[::-1]


__all__ = ["Schedule", "balance", "stage_indices", "stages_per_rank"]
