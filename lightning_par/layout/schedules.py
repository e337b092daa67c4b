"""Pipeline schedules, one row each, and the stage arithmetic every reader derives from the rows.

:data:`SCHEDULES` holds what the split, the runner, the config's checks and the planner need to know about a
schedule: how many stages a rank holds and where, whether backward is split into input- and weight-gradient
passes, the fewest micro-batches it runs, the activations a rank keeps in flight, its bubble, its report label and
PyTorch's class. Adding a schedule is adding a row (and its line in tests/test_schedules.py); nothing else names
schedules. The rows' papers:

* GPipe: Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism";
* 1F1B: Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush);
* interleaved 1F1B: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", sec. 2.2;
* ZB-V: Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (and "Pipeline Parallelism with Controllable Memory");
* DualPipeV: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (DualPipe), cut in half into a V as PyTorch's
  ``ScheduleDualPipeV``.

Pure Python: neither torch nor the package is imported (the torch class is named, and resolved where a schedule is
built, ``lightning_par.parallel.pipeline.split.build_schedule``), so ``lightning_par.layout.config`` and the planner
read the table without torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_par.layout.dimensions import FIELD_NAMES

#: The fewest micro-batches a schedule runs: any number, one per pipeline rank (fewer leave the pipeline unfilled),
#: or one per stage (DualPipeV feeds micro-batches from both ends of the V).
MicrobatchFloor = Literal["any", "one per rank", "one per stage"]

#: The idle unit of ZB-V and DualPipeV, one chunk's forward, as a share of 1F1B's idle slot (a whole rank's forward and
#: backward of one micro-batch): a chunk is half the rank, and its forward a third of its forward, input- and
#: weight-gradient passes when the three take equal time. Derived from the order the runtime runs ZB-V in (torch's
#: ``ScheduleZBVZeroBubble``), not fitted: replayed with equal passes
#: (``lightning_par.parallel.pipeline.bubble.simulated_bubble``), a rank idles ``max(p - 1, 2(2p - 1 - m))`` such
#: units of its ``6m`` (tests/test_schedules.py replays torch's order at several p and m); docs/performance.md's
#: benchmark records the same idle shares from running ranks (0.020 at p=2, 0.059 at p=4, m=8: 1/49 and 3/51).
#: Unequal passes change it: with full recomputation inside the input-gradient pass (I twice F) the replay gives 1/4,
#: with I three times W 1/3 (the planner prints a plan's sensitivity to it).
ZERO_BUBBLE_RESIDUAL = 1 / 6


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: every fact the package reads about it.

    ``in_flight(p, rank, m, v)``: micro-batches whose activations rank ``rank`` holds at its peak, in units of the
    whole rank's blocks, for ``p`` ranks, ``m`` micro-batches and ``v`` virtual stages. ``bubble(p, m, v)``: the idle
    time of a step as a fraction of its compute when every pass takes its share (the idle fraction of the step is
    ``b / (1 + b)``). ``label`` is the planner's short name, ``{v}`` standing for the virtual stages.
    """

    name: str
    label: str
    paper: str
    #: Stages per rank; ``None``: the configured ``pp_virtual_stages``.
    stages_per_rank: int | None
    #: Rank r holds stages r and 2p - 1 - r (a V) instead of r, r + p, ... (looped).
    v_shape: bool
    #: Backward runs as an input-gradient pass (I) and a later weight-gradient pass (W).
    splits_backward: bool
    #: Every micro-batch's forward runs before any backward: the last stage keeps all the micro-batches' logits.
    forwards_first: bool
    fewest_microbatches: MicrobatchFloor
    in_flight: Callable[[int, int, int, int], float]
    bubble: Callable[[int, int, int], float]
    #: The class in ``torch.distributed.pipelining.schedules`` that runs it.
    torch_class: str
    #: The planner tries schedules in this order (cheapest first); it keeps the earlier of two equally good layouts.
    search_order: int


def _all_microbatches(p: int, rank: int, m: int, v: int) -> float:
    return float(m)  # GPipe: every forward before the first backward


def _one_per_rank_ahead(p: int, rank: int, m: int, v: int) -> float:
    return float(min(m, p - rank))  # 1F1B: rank r starts its first backward after p - r forwards


def _interleaved_chunks(p: int, rank: int, m: int, v: int) -> float:
    # Megatron's warm-up: 2(p - r - 1) + (v - 1)p + 1 model chunks, each 1/v of the rank's blocks (the first rank
    # holding 1 + (p - 1)/(p·v) times 1F1B's activations).
    return min(v * m, 2 * (p - rank - 1) + (v - 1) * p + 1) / v


def _two_chunks_per_rank(p: int, rank: int, m: int, v: int) -> float:
    # Two chunks per rank and 2p chunk-micro-batches in flight, the memory of 1F1B (Qi et al. 2024); measured for
    # DualPipeV at p=2: 0.35 / 0.30 of GPipe's peak at m=8, ZB-V 0.40 / 0.41.
    return min(2 * m, 2 * p) / 2


def _fill_and_drain(p: int, m: int, v: int) -> float:
    return (p - 1) / m  # p - 1 micro-batch slots to fill and as many to drain, over m micro-batches of work


def _fill_and_drain_of_chunks(p: int, m: int, v: int) -> float:
    return (p - 1) / m / v  # the same p - 1 slots, each 1/v as long


def _filled_with_weight_passes(p: int, m: int, v: int) -> float:
    # The last rank waits p - 1 chunk forwards to start; with fewer than (3p - 1)/2 micro-batches the V is not full
    # either, and each missing micro-batch leaves two more units (the replay of torch's order, ZERO_BUBBLE_RESIDUAL).
    return max(p - 1, 2 * (2 * p - 1 - m)) / m * ZERO_BUBBLE_RESIDUAL


SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", label="gpipe", paper="Huang et al. 2019", stages_per_rank=1, v_shape=False,
                 splits_backward=False, forwards_first=True, fewest_microbatches="any", in_flight=_all_microbatches,
                 bubble=_fill_and_drain, torch_class="ScheduleGPipe", search_order=4),
    ScheduleSpec("1f1b", label="1f1b", paper="Narayanan et al. 2021 (PipeDream-Flush)", stages_per_rank=1,
                 v_shape=False, splits_backward=False, forwards_first=False, fewest_microbatches="one per rank",
                 in_flight=_one_per_rank_ahead, bubble=_fill_and_drain, torch_class="Schedule1F1B", search_order=0),
    ScheduleSpec("interleaved_1f1b", label="int{v}", paper="Narayanan et al. 2021 (Megatron-LM)",
                 stages_per_rank=None, v_shape=False, splits_backward=False, forwards_first=False,
                 fewest_microbatches="one per rank", in_flight=_interleaved_chunks, bubble=_fill_and_drain_of_chunks,
                 torch_class="ScheduleInterleaved1F1B", search_order=1),
    ScheduleSpec("zbv", label="zbv", paper="Qi et al. 2024", stages_per_rank=2, v_shape=True, splits_backward=True,
                 forwards_first=False, fewest_microbatches="one per rank", in_flight=_two_chunks_per_rank,
                 bubble=_filled_with_weight_passes, torch_class="ScheduleZBVZeroBubble", search_order=2),
    ScheduleSpec("dualpipev", label="dpv", paper="DeepSeek-AI 2024 (DeepSeek-V3, DualPipe)", stages_per_rank=2,
                 v_shape=True, splits_backward=True, forwards_first=False, fewest_microbatches="one per stage",
                 in_flight=_two_chunks_per_rank, bubble=_filled_with_weight_passes, torch_class="ScheduleDualPipeV",
                 search_order=3),
)}

#: The schedules' names, in the table's order; ``Literal`` takes the tuple as its values (LightningCLI reads them).
Schedule = Literal[tuple(SCHEDULES)]  # type: ignore[valid-type]


def stages_per_rank(schedule: Schedule, virtual_stages: int) -> int:
    """How many stages each rank holds under ``schedule``."""
    fixed = SCHEDULES[schedule].stages_per_rank
    return virtual_stages if fixed is None else fixed


def stage_indices(pp_rank: int, pp: int, schedule: Schedule, virtual_stages: int = 2) -> list[int]:
    """The stages rank ``pp_rank`` holds: looped (``r, r + pp, ...``) or V-shaped (``r, 2pp - 1 - r``)."""
    if SCHEDULES[schedule].v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule, virtual_stages))]


def fewest_microbatches(schedule: Schedule, pp: int, virtual_stages: int) -> int:
    """The fewest micro-batches ``schedule`` runs on ``pp`` ranks."""
    floor = SCHEDULES[schedule].fewest_microbatches
    if floor == "one per stage":
        return pp * stages_per_rank(schedule, virtual_stages)
    return pp if floor == "one per rank" else 1


def too_few_microbatches(n_microbatches: int, schedule: Schedule, pp: int, virtual_stages: int,
                         named: Callable[[str], str] | None = None) -> str | None:
    """Why ``n_microbatches`` are too few for ``schedule`` on ``pp`` ranks, naming the values; ``None`` if enough.
    ``named(field)`` writes ``pp`` or ``microbatches`` with its value as the user named them (by default
    ``pp=4``)."""
    least = fewest_microbatches(schedule, pp, virtual_stages)
    if n_microbatches >= least:
        return None
    values = {"pp": pp, "microbatches": n_microbatches}
    named = named or (lambda field: FIELD_NAMES.named(field, values[field]))
    if SCHEDULES[schedule].fewest_microbatches == "one per stage":
        return (f"schedule {schedule!r} needs at least {least // pp} x {named('pp')} = {least} micro-batches (one per "
                f"stage), got {named('microbatches')}; raise it to {least} or more")
    # The first row that runs any number (GPipe): a row added later does not change the advice.
    unlimited = next(name for name, spec in SCHEDULES.items() if spec.fewest_microbatches == "any")
    return (f"schedule {schedule!r} needs at least {named('pp')} micro-batches to fill the pipeline, got "
            f"{named('microbatches')}; raise it to {pp} or more (or use {unlimited!r})")


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


__all__ = ["SCHEDULES", "ZERO_BUBBLE_RESIDUAL", "MicrobatchFloor", "Schedule", "ScheduleSpec", "balance",
           "fewest_microbatches", "stage_indices", "stages_per_rank", "too_few_microbatches"]
