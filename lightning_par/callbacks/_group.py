"""What the monitoring callbacks share: their own process group (gloo on CPU tensors, kept apart from
training's) and the run's mesh."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_par.parallel.mesh import ParallelMesh
from lightning_par.parallel.pipeline.runner import PipelineRunner

_GROUP: dist.ProcessGroup | None = None
_WORLD: object = None  # the default group _GROUP was made in (a new process group needs a new one)


def monitoring_group() -> dist.ProcessGroup | None:
    """A gloo group over the whole world (None in a single process). Collective on first call.

    Its own group, so that what the callbacks exchange is accounted as ``other`` rather than as traffic of
    a mesh dimension, and so that it works with CPU tensors whatever the training backend is.
    """
    global _GROUP, _WORLD
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _GROUP is None or _WORLD is not dist.group.WORLD:
        _GROUP, _WORLD = dist.new_group(backend="gloo", group_desc="lightning_par_monitoring"), dist.group.WORLD
    return _GROUP


def gather_floats(value: float) -> list[float]:
    """``value`` of every rank, in rank order (``[value]`` in a single process). Collective."""
    group = monitoring_group()
    if group is None:
        return [value]
    values: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def strategy_mesh(trainer: Any) -> ParallelMesh | None:
    """The run's mesh under a lightning_par strategy (built at set-up), else None."""
    return getattr(trainer.strategy, "_mesh", None)


def strategy_pipeline(trainer: Any) -> PipelineRunner | None:
    """The runner of this rank's pipeline stages under a lightning_par strategy with pp > 1, else None."""
    return getattr(getattr(trainer.strategy, "_parallelized", None), "pipeline", None)
