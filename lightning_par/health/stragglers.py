"""Which rank the others wait for: every rank's own step time, from when each arrived at the step's collectives.

In synchronous training every rank's wall time per step is the same: a slow rank (a throttled GPU, a noisy
neighbour, a slow disk under its loader) makes the others wait for it inside their collectives. What differs is
when each rank *arrives* at a collective. PyTorch's flight recorder notes, on every rank, when each collective was
issued (``time_created_ns``), under the same (process group, sequence number) on every member, so arrivals can be
compared without adding a collective to the step. For each step and rank, the *lateness* is how long after the first
member of the group the rank arrived, at the collective where it was latest; a rank's own step time is the step's
wall time less the time it waited for the latest rank (its lateness short of the most late rank's, taking the median
over the steps so that one hiccup does not name anyone). A rank whose own time exceeds ``factor`` times the median
rank's is a straggler. Megatron-LM's straggler detector and NVIDIA's resiliency extension rank GPUs by their own
kernels' times in the same spirit (relative performance scores); with host clocks in step (NTP), arrival times
need no device timers and include whatever delays a rank on the host.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

__all__ = ["Arrival", "StepTimes", "arrivals_in_steps", "own_step_times"]

#: (process group name, collective sequence number, step index in the window, seconds since the epoch)
Arrival = tuple[str, int, int, float]


def arrivals_in_steps(trace: dict[str, Any] | None, step_starts_ns: list[int]) -> list[Arrival]:
    """This rank's collectives (not point-to-point sends) issued from the first of ``step_starts_ns`` on, each with
    the step it belongs to (the last start before it), from a flight recorder dump (``_dump_fr_trace``)."""
    if trace is None or not step_starts_ns:
        return []
    arrivals = []
    for entry in trace.get("entries", []):
        created = entry.get("time_created_ns")
        if entry.get("is_p2p") or created is None or created < step_starts_ns[0]:
            continue
        step = bisect.bisect_right(step_starts_ns, created) - 1
        arrivals.append((str(entry["process_group"][0]), int(entry["collective_seq_id"]), step, created / 1e9))
    return arrivals


@dataclass
class StepTimes:
    """Every rank's own step time (seconds) over a window of steps, and what they say."""

    own: list[float]
    factor: float

    @property
    def median(self) -> float:
        return statistics.median_low(self.own)

    @property
    def slowest_rank(self) -> int:
        return max(range(len(self.own)), key=self.own.__getitem__)

    @property
    def spread(self) -> float:
        """The slowest rank's own time over the fastest's."""
        return max(self.own) / max(min(self.own), 1e-9)

    @property
    def stragglers(self) -> list[int]:
        """Ranks slower than ``factor`` times the median rank (the lower median: with two ranks, the faster)."""
        return [rank for rank, own in enumerate(self.own) if own > self.factor * max(self.median, 1e-9)]


def own_step_times(reports: list[list[Arrival]], step_seconds: float, factor: float) -> StepTimes:
    """Each rank's own step time from every rank's :func:`arrivals_in_steps` (``reports[rank]``) and the wall time
    of a step: a collective counts once every member of its group reported it."""
    members: dict[str, set[int]] = defaultdict(set)
    by_collective: dict[tuple[str, int], dict[int, tuple[int, float]]] = defaultdict(dict)
    for rank, report in enumerate(reports):
        for group, sequence, step, seconds in report:
            members[group].add(rank)
            by_collective[(group, sequence)][rank] = (step, seconds)
    lateness: list[dict[int, float]] = [defaultdict(float) for _ in reports]
    for (group, _), arrived in by_collective.items():
        if len(members[group]) < 2 or arrived.keys() != members[group]:
            continue
        first = min(seconds for _, seconds in arrived.values())
        for rank, (step, seconds) in arrived.items():
            lateness[rank][step] = max(lateness[rank][step], seconds - first)
    typical = [statistics.median(late.values()) if late else 0.0 for late in lateness]
    latest = max(typical, default=0.0)
    return StepTimes([max(step_seconds - (latest - late), 0.0) for late in typical], factor)
