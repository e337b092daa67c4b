"""The time model's calibration constants, fitted by code to the published runs that name them, and held out.

Each :class:`FittedConstant` sets one :class:`~lightning_par.planner.cluster.ClusterSpec` field (on the device
presets it names, or on all of them). :func:`fit` solves, by bisection, for the value at which the rows naming a
constant in their ``fits`` are predicted exactly on average (the geometric mean of their predicted / published
ratios is 1), every other constant at its current value, and sweeps over the constants until none moves (Gauss-Seidel:
the two ZeRO-3 rows share two constants, and a constant's rows depend on the others' values). A constant that no
row names takes its prior: a data-sheet or ideal value, or the mean of its siblings' fits, never a row's figure.

:func:`leave_out` refits without some rows and predicts them from constants they did not set: one row at a time
(leave-one-out) or one source at a time (leave-one-source-out), the cross-validation of Stone 1974 ("Cross-Validatory
Choice and Assessment of Statistical Predictions"). A row that names no constant is predicted the same in and out
of sample: nothing was fitted to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_par.planner import cluster as cluster_constants
from lightning_par.planner import time as time_constants


class PublishedRow(Protocol):
    """What a fit reads of a published run (``lightning_par.planner.published.PublishedRun``)."""

    name: str
    family: str
    fits: tuple[str, ...]

    def ratio(self, constants: Mapping[str, float] | None = None) -> float: ...


@dataclass(frozen=True)
class FittedConstant:
    """A module-level constant the published rows set: the ClusterSpec ``field`` it becomes on the ``devices``
    presets (all presets when empty), the range a fit searches, and the value it takes when no row names it."""

    name: str
    field: str
    devices: tuple[str, ...]
    bounds: tuple[float, float]
    prior: float
    prior_reason: str
    # The constants whose mean fit is the prior instead, where a row names one of them (a matmul efficiency of
    # another device): the best guess for a device no row measured.
    prior_siblings: tuple[str, ...] = ()

    @property
    def value(self) -> float:
        """The value in the code (cluster.py or time.py)."""
        module = cluster_constants if hasattr(cluster_constants, self.name) else time_constants
        return float(getattr(module, self.name))


_MATMULS = ("A100_MATMUL_EFFICIENCY", "H100_MATMUL_EFFICIENCY", "H100_500W_MATMUL_EFFICIENCY")
_POOLED = "the mean of the other devices' fitted matmul efficiencies"


def _matmul(name: str, devices: tuple[str, ...]) -> FittedConstant:
    return FittedConstant(name, "compute_efficiency", devices, (0.2, 1.0), 0.5, _POOLED,
                          prior_siblings=tuple(other for other in _MATMULS if other != name))


FITTED: tuple[FittedConstant, ...] = (
    _matmul("A100_MATMUL_EFFICIENCY", ("a100-80gb", "a100-40gb")),
    _matmul("H100_MATMUL_EFFICIENCY", ("h100-80gb", "h200-141gb")),
    _matmul("H100_500W_MATMUL_EFFICIENCY", ("h100-96gb-500w",)),
    FittedConstant("COMPILED_ELEMENTWISE_FRACTION", "compiled_elementwise_fraction", (), (0.05, 1.0), 1.0,
                   "torch.compile fuses nothing: eager's traffic"),
    FittedConstant("FLOAT8_MATMUL_EFFICIENCY", "float8_matmul_efficiency", (), (0.3, 1.0), 1.0,
                   "float8 GEMMs at the matmul efficiency of the doubled float8 peak (the data sheet)"),
    FittedConstant("INFINIBAND_BUS_EFFICIENCY", "inter_node_bus_efficiency", (), (0.2, 1.0),
                   cluster_constants.NVLINK_BUS_EFFICIENCY, "NVLink's bus efficiency (nccl-tests inside a node)"),
    FittedConstant("COLLECTIVE_OVERLAP", "collective_overlap", (), (0.0, 1.0), 1.0,
                   "overlapped collectives hide behind all of the compute they run under"),
)
FITTED_BY_NAME = {constant.name: constant for constant in FITTED}


def code_values() -> dict[str, float]:
    """Every fitted constant at its value in the code."""
    return {constant.name: constant.value for constant in FITTED}


def cluster_overrides(constants: Mapping[str, float], device: str) -> dict[str, Any]:
    """The ClusterSpec fields ``constants`` set on a preset ``device``."""
    overrides: dict[str, Any] = {}
    for name, value in constants.items():
        constant = FITTED_BY_NAME[name]
        if not constant.devices or device in constant.devices:
            overrides[constant.field] = value
    return overrides


def _log_error(rows: Sequence[PublishedRow], constants: Mapping[str, float]) -> float:
    return sum(math.log(row.ratio(constants)) for row in rows) / len(rows)


def _solve(error: Callable[[float], float], bounds: tuple[float, float]) -> float:
    """The root of a monotone ``error`` in ``bounds`` by bisection; the nearer bound when there is none (a constant
    its rows barely depend on, such as an overlap that hides everything either way)."""
    low, high = bounds
    at_low, at_high = error(low), error(high)
    if at_low * at_high > 0:
        return low if abs(at_low) < abs(at_high) else high
    for _ in range(36):  # 2^-36 of the range: far below the three printed decimals
        middle = (low + high) / 2
        at_middle = error(middle)
        if at_middle * at_low > 0:
            low, at_low = middle, at_middle
        else:
            high = middle
    return (low + high) / 2


def fit(rows: Iterable[PublishedRow], start: Mapping[str, float] | None = None,
        sweeps: int = 20, tolerance: float = 1e-6) -> dict[str, float]:
    """Every :data:`FITTED` constant fitted to the ``rows`` that name it; priors for the rest. ``start``: where the
    sweeps begin (default: the priors), which changes nothing but the number of sweeps."""
    rows = list(rows)
    named = {constant.name: [row for row in rows if constant.name in row.fits] for constant in FITTED}
    values = dict(start) if start else {constant.name: constant.prior for constant in FITTED}
    for _ in range(sweeps):
        moved = 0.0
        for constant in FITTED:
            if named[constant.name]:
                value = _solve(lambda x: _log_error(named[constant.name], {**values, constant.name: x}),
                               constant.bounds)
            else:
                fitted = [values[sibling] for sibling in constant.prior_siblings if named[sibling]]
                value = sum(fitted) / len(fitted) if fitted else constant.prior
            moved = max(moved, abs(value - values[constant.name]))
            values[constant.name] = value
        if moved < tolerance:
            break
    return values


def leave_out(rows: Sequence[PublishedRow], group: Callable[[PublishedRow], str]) -> dict[str, float]:
    """Each row's predicted / published ratio with the constants refitted without its ``group`` (its name: leave
    one out; its family: leave one source out). Each refit starts from the priors, never from the fit to every row: a
    constant the remaining rows leave undetermined (two constants, one row) must not keep the left-out row's value."""
    ratios: dict[str, float] = {}
    for key in dict.fromkeys(group(row) for row in rows):
        values = fit([row for row in rows if group(row) != key])
        ratios.update({row.name: row.ratio(values) for row in rows if group(row) == key})
    return ratios


@dataclass(frozen=True)
class HoldOut:
    """The ratios of every row in sample (constants as in the code), left out alone, and left out with its source."""

    in_sample: dict[str, float]
    leave_one_out: dict[str, float]
    leave_source_out: dict[str, float]


def hold_out(rows: Sequence[PublishedRow]) -> HoldOut:
    """In-sample, leave-one-out and leave-one-source-out ratios of ``rows``."""
    return HoldOut(in_sample={row.name: row.ratio() for row in rows},
                   leave_one_out=leave_out(rows, lambda row: row.name),
                   leave_source_out=leave_out(rows, lambda row: row.family))


@dataclass(frozen=True)
class RatioError:
    """How far some ratios are from 1: ``|ratio - 1|``, mean and largest."""

    rows: int
    mean: float
    largest: float

    def __str__(self) -> str:
        return f"{self.rows} rows, mean |ratio - 1| {self.mean:.3f}, largest {self.largest:.3f}"


def ratio_error(ratios: Iterable[float]) -> RatioError:
    errors = [abs(ratio - 1) for ratio in ratios]
    return RatioError(len(errors), sum(errors) / max(len(errors), 1), max(errors, default=0.0))


__all__ = ["FITTED", "FITTED_BY_NAME", "FittedConstant", "HoldOut", "PublishedRow", "RatioError", "cluster_overrides",
           "code_values", "fit", "hold_out", "leave_out", "ratio_error"]
