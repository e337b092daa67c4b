"""Collective accounting: what each mesh dimension moved, read from PyTorch's flight recorder.

Every collective a process group runs — DDP's gradient all-reduce from C++, FSDP2's all-gathers and
reduce-scatters, DTensor's functional collectives, pipeline send/recv, expert all-to-alls — passes
through the process group, where PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE`` > 0, which
lightning_par's strategies set) keeps a record of it: operation, process group, tensor sizes and dtypes,
and on NCCL with ``TORCH_NCCL_ENABLE_TIMING=1`` its duration. Wrapping ``torch.distributed`` calls in
Python would miss most of them; the recorder misses none.

:class:`CommunicationCounter` turns the records since its last reading into totals per mesh dimension:

- ``bytes``: the message size of each collective, the larger of its input and output (the size
  nccl-tests report bandwidth against: the whole gathered tensor for an all-gather, the whole reduced one
  for a reduce-scatter or all-reduce), summed;
- ``calls``: the number of collectives;
- ``seconds``: their summed durations, where the backend measured them (NCCL with timing; gloo does not).

Point-to-point transfers between pipeline stages are counted where they are made instead
(:class:`PipelineSends`): the flight recorder keeps no record of gloo's send/recv, and counting them in
one place for every backend avoids counting NCCL's twice. A send counts its tensor's bytes.

Dimensions are named as in the mesh (``tp``, ``cp``, ``pp``, ``ep``; every data-parallel view — ``dp``,
``dp_shard``, ``dp_replicate``, ``dp_cp``, ``dp_shard_cp`` — is ``dp``). Process groups of one rank move
nothing and are left out; anything else (the default group's barriers, a checkpoint's own group) is
``other``.

Pure PyTorch: no lightning import.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_par.parallel.mesh import FLATTENED_DIMS, MESH_DIM_NAMES, ParallelMesh

__all__ = ["CommunicationCounter", "CommTotals", "DIMENSIONS", "PipelineSends", "dimension_of_group",
           "flight_recorder_trace", "message_bytes", "world_dimension"]

DIMENSIONS = ("dp", "tp", "pp", "cp", "ep", "other")
# Mesh (and sub-mesh) names -> the dimension their traffic counts for.
_LABELS = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "ep_replicate": "dp", "dp_replicate": "dp",
           "dp_shard": "dp", **{name: "dp" for name in FLATTENED_DIMS}, "cp_tp": "cp"}
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


@dataclass
class CommTotals:
    """What one dimension moved between two readings."""

    bytes: int = 0
    calls: int = 0
    seconds: float | None = None  # None when the backend does not time collectives


class PipelineSends:
    """Counts the activations and gradients this rank's pipeline stages send (bytes, sends), by wrapping the
    stages' ``get_fwd_send_ops`` / ``get_bwd_send_ops`` (``torch.distributed.pipelining``)."""

    def __init__(self, stages: list[Any]) -> None:
        self.bytes = self.calls = 0
        for stage in stages:
            for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
                setattr(stage, name, self._counted(getattr(stage, name)))

    def _counted(self, make_ops: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> list[Any]:
            ops = make_ops(*args, **kwargs)
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            self.calls += len(ops)
            return ops

        return counted

    def take(self) -> tuple[int, int]:
        """(bytes, sends) since the last call."""
        counted, self.bytes, self.calls = (self.bytes, self.calls), 0, 0
        return counted


@dataclass
class CommunicationCounter:
    """Totals per mesh dimension of the collectives recorded since the previous :meth:`read`.

    ``mesh`` names the groups the flight recorder only knows by number: a mesh dimension that spans the
    whole world reuses the default process group. ``pipeline_sends`` adds the pipeline's point-to-point
    transfers to ``pp``.
    """

    mesh: ParallelMesh
    pipeline_sends: PipelineSends | None = None
    lost: bool = False  # True once the recorder's ring buffer overflowed between two readings
    _last_record: int = -1
    _default_label: str = field(init=False, default="other")

    def __post_init__(self) -> None:
        self._default_label = world_dimension(self.mesh)
        self.read()  # start counting from now

    def read(self) -> dict[str, CommTotals]:
        """Totals of the collectives issued since the last reading, by dimension (every dimension present)."""
        trace = flight_recorder_trace()
        totals = {dimension: CommTotals() for dimension in DIMENSIONS}
        if self.pipeline_sends is not None:
            totals["pp"].bytes, totals["pp"].calls = self.pipeline_sends.take()
        if trace is None:
            return totals
        entries = [e for e in trace["entries"] if e["record_id"] > self._last_record]
        if entries and self._last_record >= 0 and entries[0]["record_id"] > self._last_record + 1:
            self.lost = True  # more collectives than the buffer holds: raise TORCH_FR_BUFFER_SIZE
        for entry in entries:
            self._last_record = max(self._last_record, entry["record_id"])
            name, desc = entry["process_group"]
            if entry.get("is_p2p") or _group_size(name) < 2:
                continue
            total = totals[dimension_of_group(desc, self._default_label)]
            total.bytes += message_bytes(entry)
            total.calls += 1
            duration = entry.get("duration_ms")
            if duration is not None:
                total.seconds = (total.seconds or 0.0) + duration / 1000
        return totals



def world_dimension(mesh: ParallelMesh) -> str:
    """The dimension whose traffic the default process group carries: a mesh dimension that spans the whole world
    reuses it (else ``other``: barriers, a checkpoint's own collectives)."""
    world = torch.distributed.group.WORLD
    for name in MESH_DIM_NAMES + tuple(FLATTENED_DIMS):
        if mesh.size(name) > 1 and mesh.group(name) == world:
            return _LABELS[name]
    return "other"


def dimension_of_group(description: str, world_label: str) -> str:
    """The dimension (:data:`DIMENSIONS`) of a process group by its description (``mesh_tp`` -> ``tp``);
    ``world_label`` (:func:`world_dimension`) for the default group."""
    if description.startswith("mesh_") and description[5:] in _LABELS:
        return _LABELS[description[5:]]
    return world_label if description == "default_pg" else "other"


def message_bytes(entry: dict[str, Any]) -> int:
    """The larger of a recorded collective's input and output sizes, in bytes."""
    def size(shapes: list[list[int]], dtypes: list[str]) -> int:
        return sum(_numel(shape) * _DTYPE_BYTES.get(dtype, 4) for shape, dtype in zip(shapes, dtypes))

    return max(size(entry.get("input_sizes") or [], entry.get("input_dtypes") or []),
               size(entry.get("output_sizes") or [], entry.get("output_dtypes") or []))


def _numel(shape: list[int]) -> int:
    count = 1
    for extent in shape:
        count *= extent
    return count


def _group_size(name: str) -> int:
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(name).size()
    except Exception:  # noqa: BLE001 - a group destroyed since: count it
        return 2


def flight_recorder_trace() -> dict[str, Any] | None:
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        return pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    except Exception:  # noqa: BLE001 - recorder off or a private API changed: no accounting, no crash
        return None
