"""ZeRO's stages, one row each (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5): what each shards over the data-parallel ranks and how it reduces gradients.

The runtime (``parallel/compose.py``, ``parallel/parallelized.py``), the config's checks and the planner read a
layout's row (``ParallelConfig.zero``) instead of comparing stage numbers, as they read ``layout/schedules.py``'s
table of pipeline schedules: a new stage is a row here plus the code of its own reduction. The rows' code:

* stage 0: PyTorch's DDP (``parallel/ddp.py``), or flattened all-reduces after backward where DDP cannot wrap the
  step (``Parallelized.after_backward``);
* stage 1: the same reduction, and ``ZeroRedundancyOptimizer``'s sharded optimizer states (``parallel/zero.py``);
* stage 2: each gradient reduced to the rank that owns its optimizer state (``parallel/zero.py``'s reducer);
* stage 3: FSDP2 (``fully_shard``), which reduce-scatters gradients and gathers parameters per unit.

Pure Python: nothing of torch or the package is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: How a stage averages gradients over the data-parallel ranks: every rank gets the whole average (all-reduce), the
#: rank that owns a parameter's optimizer state gets it (reduce to its owner), or each rank gets its shard
#: (reduce-scatter).
GradientReduction = Literal["all-reduce", "to owners", "reduce-scatter"]


@dataclass(frozen=True)
class ZeroStage:
    """One stage: what it shards over the data-parallel ranks, how it reduces gradients, its report label and the
    words the config's error lists it with."""

    level: int
    shards_optimizer_states: bool
    shards_gradients: bool
    shards_parameters: bool
    gradient_reduction: GradientReduction
    label: str
    summary: str


ZERO_STAGE_ROWS = {
    0: ZeroStage(0, shards_optimizer_states=False, shards_gradients=False, shards_parameters=False,
                 gradient_reduction="all-reduce", label="DDP", summary="DDP"),
    1: ZeroStage(1, shards_optimizer_states=True, shards_gradients=False, shards_parameters=False,
                 gradient_reduction="all-reduce", label="ZeRO-1", summary="optimizer states sharded"),
    2: ZeroStage(2, shards_optimizer_states=True, shards_gradients=True, shards_parameters=False,
                 gradient_reduction="to owners", label="ZeRO-2", summary="+ gradients"),
    3: ZeroStage(3, shards_optimizer_states=True, shards_gradients=True, shards_parameters=True,
                 gradient_reduction="reduce-scatter", label="ZeRO-3/FSDP2", summary="+ parameters"),
}

#: The stage numbers a layout may ask for.
ZERO_STAGES = tuple(ZERO_STAGE_ROWS)

__all__ = ["GradientReduction", "ZERO_STAGES", "ZERO_STAGE_ROWS", "ZeroStage"]
