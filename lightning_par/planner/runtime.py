"""Planning for a run whose data loader fixes the batch per data-parallel rank (Lightning's convention).

A Lightning ``DataModule`` hands every data-parallel rank ``batch_size`` sequences per step, so the global
batch grows with the data-parallel size the planner chooses. Layouts with different data-parallel sizes
then train on different global batches, and are compared by throughput (tokens per second), not by step
time. Used by the ``hybrid3d`` / ``auto_parallel`` strategies when sizes are left ``"auto"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par.layout.config import ParallelConfig, divisors
from lightning_par.planner.cluster import ClusterSpec
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.search import Candidate, TrainingSpec, normalize_fixed, plan_layouts


def plan_for_run(model: ModelSpec, cluster: ClusterSpec, *, batch_size_per_rank: int, seq_len: int,
                 precision: str = "32-true", accumulate_grad_batches: int = 1,
                 fixed: dict[str, Any] | None = None, training_options: dict[str, Any] | None = None,
                 composable: Callable[[ParallelConfig], bool] | None = None) -> list[Candidate]:
    """Layouts that fit, fastest in tokens per second first, for a loader giving each data-parallel rank
    ``batch_size_per_rank`` sequences of ``seq_len`` tokens per step.

    Without pipeline parallel each step is one micro-batch of the whole per-rank batch (Lightning's
    ``accumulate_grad_batches`` steps per optimizer step); with it the batch is cut into the pipeline's
    micro-batches. ``fixed`` keeps what the user chose (see :func:`plan_layouts`); ``training_options``
    passes further :class:`TrainingSpec` fields (which recomputation modes or schedules may be used);
    ``composable`` is :func:`plan_layouts`'s.
    Raises ``ValueError`` when nothing fits, with the planner's reason for the largest data-parallel size.
    """
    fixed = normalize_fixed(fixed)
    per_step = batch_size_per_rank * accumulate_grad_batches  # sequences per data-parallel rank per optimizer step
    micro_batch_sizes = tuple(divisors(batch_size_per_rank))
    pooled: list[Candidate] = []
    errors: list[str] = []
    for dp in divisors(cluster.world_size) if "dp" not in fixed else [fixed["dp"]]:
        training = TrainingSpec(global_batch_size=per_step * dp, seq_len=seq_len, precision=precision,
                                microbatch_size=micro_batch_sizes, **(training_options or {}))
        try:
            candidates = plan_layouts(model, cluster, training, fixed={**fixed, "dp": dp}, composable=composable)
        except ValueError as error:
            errors.append(str(error))
            continue
        pooled += [c for c in candidates if _loader_can_feed(c, batch_size_per_rank)]
    if not pooled:
        reason = errors[-1] if errors else "no layout cuts the loader's batch into the micro-batches it needs"
        raise ValueError(f"no layout of {model.name} fits {cluster.world_size} {cluster.name} devices with "
                         f"batch_size={batch_size_per_rank} per data-parallel rank and seq_len={seq_len}: {reason}")
    return sorted(pooled, key=lambda c: (-c.tokens_per_second, c.memory.total))


def _loader_can_feed(candidate: Candidate, batch_size: int) -> bool:
    """Whether the run executes the candidate as costed: Lightning steps on whole loader batches."""
    if candidate.config.pp == 1:
        return candidate.microbatch_size == batch_size
    # The pipeline cuts each loader batch into microbatches; accumulation repeats that.
    return candidate.config.microbatches * candidate.microbatch_size == batch_size


__all__ = ["plan_for_run"]
