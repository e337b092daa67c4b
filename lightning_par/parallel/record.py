"""What :func:`~lightning_par.parallel.compose.parallelize` did to a module, kept beside it, never on it.

The layout it was split for, this rank's pipeline stages, the parameters several stages hold, ZeRO-2's gradient
reducer and whether it draws in dropout streams are looked up by the module (a weak reference: the record goes when
the module does), so no attribute of lightning_par's is set on a user's module and a ``state_dict`` or ``deepcopy``
of it carries none. A module is laid out once; fit and then validate on it (the usual Lightning sequence) find the
record again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from torch import nn

__all__ = ["LayoutRecord", "layout_record"]


@dataclass
class LayoutRecord:
    """The record of one module: ``layout`` (mesh sizes, config) once parallelized, its ``stages`` (this rank's
    pipeline stages), ``ties`` (``StageTies``), ``gradient_reducer`` (ZeRO-2's ``GradientReducer``) and
    ``random_streams`` (whether its random draws run in the dropout streams of ``rng``)."""

    layout: tuple | None = None
    stages: list = field(default_factory=list)
    ties: Any = None
    gradient_reducer: Any = None
    random_streams: bool = False


_RECORDS: WeakKeyDictionary[nn.Module, LayoutRecord] = WeakKeyDictionary()


def layout_record(module: nn.Module, *, create: bool = False) -> LayoutRecord | None:
    """The record of ``module``; a new empty one with ``create``, else None when there is none."""
    record = _RECORDS.get(module)
    if record is None and create:
        record = _RECORDS[module] = LayoutRecord()
    return record
